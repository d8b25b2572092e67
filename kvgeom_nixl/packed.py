"""One packed attempt on one rank: chunks pipelined through the staging ring (docs/design.md §12.5).

    D rank (pull | accept_push)                           P rank (serve_pull | push)
      req --------------------------------------------->  (every consumer of the request asked)
          <---------------------------------------------  want c            (to the chunk's lowest D rank)
      (every source of c wants it; slots granted in the
       order chunks became wanted, one queue per ring)
      slot c s_d -------------------------------------->  next D rank of c: want c ... (one at a time)
                                                          (every D rank of c granted) reserve s_p, pack c
      pull:  <-- packed c s_p --  READ s_p -> s_d + NIXL "chunk_pulled c" -->  free s_p
             (D READs each P rank's part as soon as that rank's "packed" arrives)
      push:  <-- WRITE s_p -> s_d + NIXL "landed c" --                        free s_p once written
      unpack c from s_d, free s_d;  after the last chunk: zeros (D), done, acked --> P done

Every chunk is a small state machine (``new`` -> ``queued`` -> ``granted`` -> ``wire`` | ``landed``
-> ``unpacking`` -> ``done`` on D; ``new`` -> ``wanted`` -> ``slotted`` -> ``packing`` ->
``served`` | ``wire`` -> ``done`` on P); :meth:`PackedTransfer.advance` moves each as far as it can
without blocking. A chunk takes its D slots one D rank at a time in rank order and its P slots
last, and a P slot never waits for another P rank, so no rank holds a slot waiting for a peer that
holds one waiting for it: requests posted in different orders on different ranks all complete,
whatever the fan-in and fan-out of the chunks (capacity limits throughput, not liveness;
docs/design.md §8.1). A failure sends ``cancel`` to the peers and keeps each slot a NIXL request or
a peer may still touch until NIXL reports the request finished and the peer has said so (its
``landed``/``chunk_pulled``, its ``ended``) or is gone; no timer frees a slot.

Worked number: a D rank with 2 slots and a 5-chunk request holds chunks 0 and 1 first; chunk 2 is
granted as soon as chunk 0 is unpacked and its slot freed. A chunk of P TP1 -> D TP2 asks D rank 0,
then D rank 1: one ``want``/``slot`` round trip more for the first chunk of a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from kvgeom import PlanError, Request, TransferPlan

from .agent import RankAgent
from .errors import ExecutorError
from .handshake import RankInfo
from .protocol import Message
from .staging import StagingBuffer
from .transfer import Messenger, ReceiveSteps, Transfer

__all__ = ["PackedTransfer", "DEFAULT_GRACE_S"]

DEFAULT_GRACE_S = 5.0
"""How often a failed transfer repeats its ``cancel`` to a peer it still waits for (a lost message)."""


@attrs.define
class _Chunk:
    """One chunk on this rank: its peers and rows, and how far it got."""

    index: int
    peers: tuple[int, ...]  # P ranks (on D) or D ranks (on P) with a wire row in this chunk
    rows: np.ndarray  # indices into the rank's wire rows
    phase: str = "new"
    slot: int = -1
    peer_slots: dict[int, int] = attrs.Factory(dict)
    wanted_from: set[int] = attrs.Factory(set)  # P: D ranks sent "want" for this chunk (one at a time, in rank order)
    heard: set[int] = attrs.Factory(set)  # peers whose want (D) / chunk_pulled (P serve) / landed (D push) arrived
    handles: list[Any] = attrs.Factory(list)
    touching: set[str] = attrs.Factory(set)  # after a failure: peer agents that may still touch the slot
    event: Any = None
    started: float = 0.0


class PackedTransfer(Transfer):
    """A packed attempt on one rank (kind ``pull`` | ``accept_push`` on D, ``serve_pull`` | ``push`` on P).

    Made by a :class:`~kvgeom_nixl.Link`; ``infos`` maps peer ranks to their handshakes (with their
    staging buffers), ``run_steps(steps, slot, pack)`` runs pack or unpack steps on this rank's
    regions and returns a CUDA event or None.
    """

    direct = False

    def __init__(self, endpoint: Messenger, agent: RankAgent, kind: str, request_id: str, request: Request | None,
                 plan: TransferPlan, timeout_s: float, *, role: str, rank: int, buffer: StagingBuffer,
                 peers: dict[int, RankInfo], run_steps: Callable[[Any, int, bool], Any],
                 receive: ReceiveSteps | None = None, grace_s: float = DEFAULT_GRACE_S, started: float | None = None,
                 invalid_blocks: Mapping[int, tuple[int, ...]] | None = None) -> None:
        super().__init__(endpoint, agent, kind, request_id, request, plan, "coalesced", timeout_s, role=role,
                         rank=rank, peers={info.agent: r for r, info in peers.items()}, receive=receive,
                         started=started, invalid_blocks=invalid_blocks, resend_s=grace_s)
        self.buffer = buffer
        self.infos = peers
        self.run_steps = run_steps
        self.grace_s = grace_s
        mine = plan.for_decode_rank(rank) if self.on_decode else plan.packed_for_prefill_rank(rank)
        self.steps = mine.unpacks if self.on_decode else mine.packs
        self.wire = mine.wire
        peer_col = self.wire.p_rank if self.on_decode else self.wire.d_rank
        self.chunks: list[_Chunk] = []
        for c in np.unique(self.wire.chunk).tolist():
            rows = np.flatnonzero(self.wire.chunk == c)
            self.chunks.append(_Chunk(int(c), tuple(int(p) for p in np.unique(peer_col[rows])), rows))
        self.by_index = {ch.index: ch for ch in self.chunks}
        self.asked: set[int] = set()  # P: D ranks whose req arrived
        self.pack_s = 0.0
        self.wire_s = 0.0
        self.unpack_s = 0.0
        self.bytes_moved = self.wire.total_bytes

    # ---- checks before anything moves ----------------------------------------------------------------
    def check_fit(self) -> None:
        """Every wire row fits this rank's slot and the peer's; raises :class:`PlanError` (a plan from
        a peer is untrusted, docs/design.md §8), or :class:`ExecutorError` when a peer has no ring."""
        w = self.wire
        own_off = w.d_offset if self.on_decode else w.p_offset
        peer_off = w.p_offset if self.on_decode else w.d_offset
        peer_col = w.p_rank if self.on_decode else w.d_rank
        if len(w) and int((own_off + w.nbytes).max()) > self.buffer.slot_bytes:
            raise PlanError("plan.wire", f"a wire row ends at byte {int((own_off + w.nbytes).max())} of this rank's "
                            f"{self.buffer.slot_bytes} B slot", actual=int((own_off + w.nbytes).max()),
                            expected=f"<= {self.buffer.slot_bytes}",
                            fix="make the endpoints' staging slots at least as large as the plan's busiest chunk")
        for r in range(len(w)):
            info = self.infos[int(peer_col[r])]
            if info.staging is None:
                raise ExecutorError("peer staging", f"peer rank {int(peer_col[r])} has no staging buffer",
                                    fix="create every endpoint of both engines with staging_bytes > 0")
            if int(peer_off[r] + w.nbytes[r]) > info.staging[3]:
                raise PlanError("plan.wire", f"wire row {r} ends at byte {int(peer_off[r] + w.nbytes[r])} of peer rank "
                                f"{int(peer_col[r])}'s {info.staging[3]} B slot", actual=int(peer_off[r] + w.nbytes[r]),
                                expected=f"<= {info.staging[3]}")

    # ---- messages -------------------------------------------------------------------------------------
    def _chunk_of(self, m: Message) -> tuple[_Chunk, int] | None:
        ch = self.by_index.get(m.args[0]) if m.args else None
        rank = self.peers[m.sender]
        if ch is None or rank not in ch.peers:
            self.endpoint.count("stale")
            return None
        return ch, rank

    def _slot_arg(self, rank: int, slot: int) -> int:
        staging = self.infos[rank].staging
        if staging is None or not 0 <= slot < staging[4]:
            raise PlanError("notification", f"peer rank {rank} names slot {slot} of its "
                            f"{0 if staging is None else staging[4]}", actual=slot,
                            expected=f"< {0 if staging is None else staging[4]}")
        return slot

    def _on(self, m: Message) -> None:
        k = m.kind
        if k == "req" and not self.on_decode:
            self.asked.add(self.peers[m.sender])
            return
        if k == "acked" and self.kind in ("push", "serve_pull"):  # D is done
            self.confirmed.add(m.sender)
            return
        got = self._chunk_of(m) if k in ("want", "slot", "packed", "chunk_pulled", "landed") else None
        if got is None:
            if k not in ("want", "slot", "packed", "chunk_pulled", "landed"):
                self.endpoint.count("stale")
            return
        ch, rank = got
        if self.on_decode and k == "want" and ch.phase == "new":
            ch.heard.add(rank)
            if len(ch.heard) == len(ch.peers):
                ch.phase = "queued"
                ch.heard = set()
                self.buffer.waiting.append((self, ch.index))  # granted in the order chunks became wanted
        elif self.on_decode and k == "packed" and self.kind == "pull" and ch.phase == "granted" \
                and rank not in ch.peer_slots:  # READ each P rank's part as soon as it is packed
            ch.peer_slots[rank] = self._slot_arg(rank, m.args[1])
            self._post_peer(ch, rank, "READ", "chunk_pulled")
            if len(ch.peer_slots) == len(ch.peers):
                ch.phase = "wire"
        elif self.on_decode and k == "landed" and self.kind == "accept_push" and ch.phase == "granted":
            ch.heard.add(rank)
            if len(ch.heard) == len(ch.peers):
                ch.phase = "landed"
        elif not self.on_decode and k == "slot" and ch.phase == "wanted" and rank in ch.wanted_from \
                and rank not in ch.peer_slots:
            ch.peer_slots[rank] = self._slot_arg(rank, m.args[1])
            if len(ch.peer_slots) == len(ch.peers):
                ch.phase = "slotted"
            else:
                self._want_next(ch)
        elif not self.on_decode and k == "chunk_pulled" and self.kind == "serve_pull" and ch.phase == "served":
            ch.heard.add(rank)
            if len(ch.heard) == len(ch.peers):
                self.buffer.release(ch.slot)
                ch.slot, ch.phase = -1, "done"
        else:
            self.endpoint.count("stale")

    def _late(self, m: Message) -> None:
        """After a failure, a chunk's completion message clears that peer's fence on its slot."""
        if m.kind in ("chunk_pulled", "landed") and m.args:
            ch = self.by_index.get(m.args[0])
            if ch is not None:
                ch.touching.discard(m.sender)
                self._union_touching()

    def grant(self, index: int) -> bool:
        """D: reserve a slot for queued chunk ``index`` and tell its P ranks (the ring's queue calls this)."""
        ch = self.by_index[index]
        if self.settled or ch.phase != "queued":
            return True  # nothing to grant: the queue drops it
        slot = self.buffer.acquire((self.request_id, ch.index))
        if slot is None:
            return False
        ch.slot, ch.phase = slot, "granted"
        try:
            for p in ch.peers:
                self._say(self.infos[p].agent, "slot", ch.index, slot)
        except Exception as e:  # noqa: BLE001 - a NIXL error: the transfer fails, the slot is fenced
            self.fail("nixl_error", f"granting a slot: {type(e).__name__}: {e}")
        return True

    # ---- the state machine ----------------------------------------------------------------------------
    def _step(self) -> None:
        if self.state == "posted":
            if self.on_decode:
                self._advance_decode()
            else:
                self._advance_prefill()
            if all(ch.phase == "done" for ch in self.chunks) and (
                    self.on_decode or len(self.confirmed) == len(self.peers)):  # P: once D said done
                self.state = "landed"  # the zeros (D) and the result: Transfer's own steps
        if self.state in ("landed", "receiving"):
            super()._step()

    def _run(self, ch: _Chunk, pack: bool) -> None:
        ch.started = time.perf_counter()
        steps = [s for s in self.steps if s.chunk == ch.index]
        ch.event = self.run_steps(steps, ch.slot, pack)
        if ch.event is None:  # host memory: done already
            self._timed(pack, time.perf_counter() - ch.started)

    def _timed(self, pack: bool, seconds: float) -> None:
        if pack:
            self.pack_s += seconds
        else:
            self.unpack_s += seconds

    def _event_done(self, ch: _Chunk, pack: bool) -> bool:
        if ch.event is None:
            return True
        if not ch.event.query():
            return False
        ch.event = None
        self._timed(pack, time.perf_counter() - ch.started)
        return True

    def _post(self, ch: _Chunk, op: str, notif_kind: str) -> None:
        """One NIXL request per peer: this rank's slot rows against the peer's slot rows."""
        for peer in ch.peers:
            self._post_peer(ch, peer, op, notif_kind)

    def _post_peer(self, ch: _Chunk, peer: int, op: str, notif_kind: str) -> None:
        """The NIXL request of chunk ``ch`` with one peer rank (its slot rows against this rank's)."""
        w = self.wire
        if not ch.handles:
            ch.started = time.perf_counter()
        info = self.infos[peer]
        staging = info.staging
        if staging is None:
            raise ExecutorError("peer staging", f"peer rank {peer} has no staging buffer")
        peer_slot = ch.peer_slots[peer]
        rows = ch.rows[(w.p_rank if self.on_decode else w.d_rank)[ch.rows] == peer]
        own = (w.d_offset if self.on_decode else w.p_offset)[rows]
        theirs = (w.p_offset if self.on_decode else w.d_offset)[rows]
        n = w.nbytes[rows]
        local = _descs(self.buffer.addr + self.buffer.base(ch.slot), own, n, self.buffer.device_id)
        remote = _descs(staging[0] + peer_slot * staging[3], theirs, n, staging[2])
        notif = self.endpoint.signed(self, info.agent, notif_kind, ch.index)
        h = self.agent.post_coalesced(op, local, remote, info.mem_type, info.agent, notif)
        ch.handles.append(h)
        self.descriptors += len(rows)
        self.nixl_requests += 1

    def _handles_done(self, ch: _Chunk) -> bool:
        still = ch.handles = self._reap(ch.handles, "a wire request")
        if not still:
            self.wire_s += time.perf_counter() - ch.started
        return not still

    def _advance_decode(self) -> None:
        for ch in self.chunks:
            if ch.phase == "wire" and self._handles_done(ch):
                ch.phase = "landed"
            if ch.phase == "landed":
                self._run(ch, pack=False)
                ch.phase = "unpacking"
            if ch.phase == "unpacking" and self._event_done(ch, pack=False):
                self.buffer.release(ch.slot)
                ch.slot, ch.phase = -1, "done"

    def _want_next(self, ch: _Chunk) -> None:
        """P: ask the next D rank of ``ch`` (in rank order) for a slot, once the lower ones granted
        theirs: every chunk takes D slots in one global order, so no two chunks wait on each other."""
        nxt = next((d for d in ch.peers if d not in ch.peer_slots), None)
        if nxt is not None and nxt not in ch.wanted_from and nxt in self.asked:
            ch.wanted_from.add(nxt)
            self._say(self.infos[nxt].agent, "want", ch.index)

    def _advance_prefill(self) -> None:
        for ch in self.chunks:
            if ch.phase == "new" and all(d in self.asked for d in ch.peers):
                ch.phase = "wanted"
            if ch.phase == "wanted":
                self._want_next(ch)
        for ch in self.chunks:  # in chunk order: a P slot only for a chunk whose D slots are granted
            if ch.phase == "slotted":
                slot = self.buffer.acquire((self.request_id, ch.index))
                if slot is None:
                    break
                ch.slot = slot
                self._run(ch, pack=True)
                ch.phase = "packing"
            if ch.phase == "packing" and self._event_done(ch, pack=True):
                if self.kind == "push":
                    self._post(ch, "WRITE", "landed")
                    ch.phase = "wire"
                else:
                    for d in ch.peers:
                        self._say(self.infos[d].agent, "packed", ch.index, ch.slot)
                    ch.phase = "served"
            if ch.phase == "wire" and self._handles_done(ch):
                self.buffer.release(ch.slot)
                ch.slot, ch.phase = -1, "done"

    def _waiting_for(self) -> str:
        phases = sorted({ch.phase for ch in self.chunks if ch.phase != "done"})
        return "chunks " + ", ".join(phases) if phases else "the peers' acknowledgement"

    # ---- failure and fences ----------------------------------------------------------------------------
    def _on_fail(self) -> None:
        """Which slots stay taken: those a NIXL request, a CUDA step or a peer may still touch."""
        super()._on_fail()
        self.touching.clear()
        for ch in self.chunks:
            if ch.slot < 0:
                continue
            if self.on_decode and self.kind == "accept_push" and ch.phase == "granted":
                ch.touching = {self.infos[p].agent for p in ch.peers if p not in ch.heard}  # a P may still WRITE
            elif not self.on_decode and ch.phase == "served":
                ch.touching = {self.infos[d].agent for d in ch.peers if d not in ch.heard}  # a D may still READ
            ch.phase = "fencing"
        self._union_touching()

    def _union_touching(self) -> None:
        self.touching = set().union(*(ch.touching for ch in self.chunks)) if self.chunks else set()

    def _peer_over(self, agent: str) -> None:
        for ch in self.chunks:
            ch.touching.discard(agent)
        self._union_touching()

    def _advance_slots(self) -> None:
        for ch in self.chunks:
            if ch.slot < 0:
                continue
            still = []
            for h in ch.handles:
                try:
                    busy = not self.agent.closed and self.agent.state(h) == "PROC"
                except Exception:  # noqa: BLE001 - an error state: finished
                    busy = False
                if busy:
                    still.append(h)
                    continue
                try:
                    self.agent.release(h)
                except Exception:  # noqa: BLE001,S110 - NIXL keeps what it cannot release
                    pass
            ch.handles = still
            if ch.event is not None and not self.agent.closed:
                try:
                    if not ch.event.query():
                        continue
                except Exception:  # noqa: BLE001,S110 - a broken event: finished
                    pass
                ch.event = None
            if not ch.handles and not ch.touching:
                self.buffer.release(ch.slot)
                ch.slot = -1
        self._union_touching()

    def _slots_fenced(self) -> bool:
        return all(ch.slot < 0 for ch in self.chunks)

    def _finish(self) -> None:
        super()._finish()
        if self.result is not None:
            self.result = attrs.evolve(self.result, bytes_moved=self.wire.total_bytes, pack_s=self.pack_s,
                                       wire_s=self.wire_s, unpack_s=self.unpack_s, chunks=len(self.chunks))


def _descs(base: int, offset: np.ndarray, nbytes: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((len(offset), 3), np.uint64)
    out[:, 0] = np.uint64(base) + offset.astype(np.uint64)
    out[:, 1] = nbytes.astype(np.uint64)
    out[:, 2] = device
    return out
