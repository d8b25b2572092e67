"""One packed request on one rank: chunks pipelined through the staging ring (docs/design.md §12.5).

    D rank (pull | accept_push)                           P rank (serve_pull | push)
    for each chunk c with wire rows to this rank, in order, while a slot is free:
      reserve slot s_d, send "slot c s_d" to c's P ranks  ->  once every consumer of c announced and a
                                                              slot is free: reserve s_p, pack c (torch)
      pull:  <- "packed c s_p"; READ s_p -> s_d,          ->  (NIXL: "chunk_pulled c" after the data)
             notification "chunk_pulled c"                    free s_p
      push:  <- WRITE s_p -> s_d + "landed c"             <-  WRITE per consumer; free s_p when done
      unpack c from s_d (torch), free s_d
    after the last chunk: the zeros (D), done

Every chunk is a small state machine (``announced`` -> ``wire`` -> ``landed`` -> ``unpacking`` ->
``done`` on D; ``packing`` -> ``served`` | ``wire`` -> ``done`` on P); :meth:`PackedTransfer.advance`
moves each as far as it can without blocking. With two slots, chunk c + 1 is packed while chunk c
is on the wire. A failure sends ``abort`` to the peers and frees this transfer's slots; a slot that a
NIXL request or a peer may still touch is quarantined until that settles or the grace time ends.

Worked number: a D rank with 2 slots and a 5-chunk request holds chunks 0 and 1 first; chunk 2 is
announced as soon as chunk 0 is unpacked and its slot freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from kvgeom import PlanError, Request, TransferPlan

from .agent import RankAgent, nixl_errors, notification
from .errors import ExecutorError
from .handshake import RankInfo
from .staging import StagingBuffer
from .transfer import Driver, ReceiveSteps, Transfer

__all__ = ["PackedTransfer", "DEFAULT_GRACE_S"]

DEFAULT_GRACE_S = 5.0
_KINDS = ("slot", "packed", "chunk_pulled", "landed", "abort")  # the notifications of a packed transfer
"""How long a failed transfer's slot stays quarantined at most, waiting for a peer that may still touch it."""


@attrs.define
class _Chunk:
    """One chunk on this rank: its peers and rows, and how far it got."""

    index: int
    peers: tuple[int, ...]  # P ranks (on D) or D ranks (on P) with a wire row in this chunk
    rows: np.ndarray  # indices into the rank's wire rows
    phase: str = "new"
    slot: int = -1
    peer_slots: dict[int, int] = attrs.Factory(dict)
    handles: list[Any] = attrs.Factory(list)
    event: Any = None
    started: float = 0.0


class PackedTransfer(Transfer):
    """A packed request on one rank (kind ``pull`` | ``accept_push`` on D, ``serve_pull`` | ``push`` on P).

    Made by a :class:`~kvgeom_nixl.Link`; ``peers`` maps peer ranks to their handshakes (with their
    staging buffers), ``run_steps(steps, slot, pack)`` runs pack or unpack steps on this rank's
    regions and returns a CUDA event or None.
    """

    def __init__(self, endpoint: Driver, agent: RankAgent, kind: str, request_id: str, request: Request | None,
                 plan: TransferPlan, timeout_s: float, *, role: str, rank: int, buffer: StagingBuffer,
                 peers: dict[int, RankInfo], run_steps: Callable[[Any, int, bool], Any],
                 receive: ReceiveSteps | None = None, grace_s: float = DEFAULT_GRACE_S, started: float | None = None,
                 invalid_blocks: Mapping[int, tuple[int, ...]] | None = None) -> None:
        super().__init__(endpoint, agent, kind, request_id, request, plan, "coalesced", timeout_s, role=role,
                         rank=rank, receive=receive, started=started, invalid_blocks=invalid_blocks)
        for notif in _KINDS:  # kept in the inbox (never evicted) until this transfer drops them
            agent.claim(notif, request_id)
        self.buffer = buffer
        self.peers = peers
        self.run_steps = run_steps
        self.grace_s = grace_s
        self.on_decode = role == "decode"
        mine = plan.for_decode_rank(rank) if self.on_decode else plan.packed_for_prefill_rank(rank)
        self.steps = mine.unpacks if self.on_decode else mine.packs
        self.wire = mine.wire
        peer_col = self.wire.p_rank if self.on_decode else self.wire.d_rank
        self.chunks: list[_Chunk] = []
        for c in np.unique(self.wire.chunk).tolist():
            rows = np.flatnonzero(self.wire.chunk == c)
            self.chunks.append(_Chunk(int(c), tuple(int(p) for p in np.unique(peer_col[rows])), rows))
        self.next = 0
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
            info = self.peers[int(peer_col[r])]
            if info.staging is None:
                raise ExecutorError("peer staging", f"peer rank {int(peer_col[r])} has no staging buffer",
                                    fix="create every endpoint of both engines with staging_bytes > 0")
            if int(peer_off[r] + w.nbytes[r]) > info.staging[3]:
                raise PlanError("plan.wire", f"wire row {r} ends at byte {int(peer_off[r] + w.nbytes[r])} of peer rank "
                                f"{int(peer_col[r])}'s {info.staging[3]} B slot", actual=int(peer_off[r] + w.nbytes[r]),
                                expected=f"<= {info.staging[3]}")

    # ---- the state machine ----------------------------------------------------------------------------
    def _step(self) -> None:
        if self.state == "posted":
            self._check_abort()
            if self.settled:
                return
            if self.on_decode:
                self._advance_decode()
            else:
                self._advance_prefill()
            if all(ch.phase == "done" for ch in self.chunks):
                self.state = "landed"  # the zeros (D) and the result: Transfer's own steps
        if self.state in ("landed", "receiving"):
            super()._step()

    def _check_abort(self) -> None:
        senders = self.agent.senders("abort", self.request_id)
        mine = {self.peers[p].agent for ch in self.chunks for p in ch.peers}
        if senders & mine:
            self.fail("aborted", f"peer {sorted(senders & mine)[0]} gave up on the request")

    def _chunk_args(self, kind: str, chunk: int) -> dict[int, tuple[int, ...]]:
        """Per peer rank, the args of its ``kind`` notification for ``chunk`` (first argument)."""
        by_agent = {info.agent: rank for rank, info in self.peers.items()}
        out: dict[int, tuple[int, ...]] = {}
        for sender, arg_list in self.agent.messages(kind, self.request_id).items():
            if sender not in by_agent:
                continue
            for args in arg_list:
                if args and args[0] == chunk:
                    out[by_agent[sender]] = args
        return out

    def _send(self, peer: int, kind: str, *args: int) -> None:
        self.agent.send(self.peers[peer].agent, notification(kind, self.request_id, *args))

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

    def _post(self, ch: _Chunk, op: str, notif: bytes) -> None:
        """One NIXL request per peer: this rank's slot rows against the peer's slot rows."""
        w = self.wire
        ch.started = time.perf_counter()
        for peer in ch.peers:
            info = self.peers[peer]
            staging = info.staging
            if staging is None:
                raise ExecutorError("peer staging", f"peer rank {peer} has no staging buffer")
            peer_slot = ch.peer_slots[peer]
            if not 0 <= peer_slot < staging[4]:
                raise PlanError("notification", f"peer rank {peer} names slot {peer_slot} of its {staging[4]}",
                                actual=peer_slot, expected=f"< {staging[4]}")
            rows = ch.rows[(w.p_rank if self.on_decode else w.d_rank)[ch.rows] == peer]
            own = (w.d_offset if self.on_decode else w.p_offset)[rows]
            theirs = (w.p_offset if self.on_decode else w.d_offset)[rows]
            n = w.nbytes[rows]
            local = _descs(self.buffer.addr + self.buffer.base(ch.slot), own, n, self.buffer.device_id)
            remote = _descs(staging[0] + peer_slot * staging[3], theirs, n, staging[2])
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
        while self.next < len(self.chunks):  # announce chunks in order while slots are free
            ch = self.chunks[self.next]
            slot = self.buffer.acquire((self.request_id, ch.index))
            if slot is None:
                break
            ch.slot, ch.phase = slot, "announced"
            self.next += 1
            for p in ch.peers:
                self._send(p, "slot", ch.index, slot)
        for ch in self.chunks[:self.next]:
            if ch.phase == "announced":
                if self.kind == "pull":
                    packed = self._chunk_args("packed", ch.index)
                    if all(p in packed for p in ch.peers):
                        ch.peer_slots = {p: packed[p][1] for p in ch.peers}
                        self._post(ch, "READ", notification("chunk_pulled", self.request_id, ch.index))
                        ch.phase = "wire"
                elif all(p in self._chunk_args("landed", ch.index) for p in ch.peers):
                    ch.phase = "landed"
            if ch.phase == "wire" and self._handles_done(ch):
                ch.phase = "landed"
            if ch.phase == "landed":
                self._run(ch, pack=False)
                ch.phase = "unpacking"
            if ch.phase == "unpacking" and self._event_done(ch, pack=False):
                self.buffer.release(ch.slot)
                ch.phase = "done"

    def _advance_prefill(self) -> None:
        while self.next < len(self.chunks):  # pack chunks in order once every consumer has a slot ready
            ch = self.chunks[self.next]
            announced = self._chunk_args("slot", ch.index)
            if not all(d in announced for d in ch.peers):
                break
            slot = self.buffer.acquire((self.request_id, ch.index))
            if slot is None:
                break
            ch.slot = slot
            ch.peer_slots = {d: announced[d][1] for d in ch.peers}
            self.next += 1
            self._run(ch, pack=True)
            ch.phase = "packing"
        for ch in self.chunks[:self.next]:
            if ch.phase == "packing" and self._event_done(ch, pack=True):
                if self.kind == "push":
                    self._post(ch, "WRITE", notification("landed", self.request_id, ch.index))
                    ch.phase = "wire"
                else:
                    for d in ch.peers:
                        self._send(d, "packed", ch.index, ch.slot)
                    ch.phase = "served"
            if ch.phase == "served" and all(d in self._chunk_args("chunk_pulled", ch.index) for d in ch.peers):
                self.buffer.release(ch.slot)
                ch.phase = "done"
            if ch.phase == "wire" and self._handles_done(ch):
                self.buffer.release(ch.slot)
                ch.phase = "done"

    # ---- failure and results ---------------------------------------------------------------------------
    def fail(self, reason: str, detail: str) -> None:
        if self.settled:
            return
        for ch in self.chunks:
            self._free_on_failure(ch)
        peers = sorted({p for ch in self.chunks for p in ch.peers})
        for p in peers:  # best effort: a dead peer cannot be told
            try:
                self._send(p, "abort")
            except nixl_errors():
                pass
            except Exception:  # noqa: BLE001,S110 - the agent may be closed already
                pass
        super().fail(reason, detail)
        for kind in _KINDS[:-1]:
            self.agent.drop(kind, self.request_id)
        self.agent.unclaim("abort", self.request_id)  # the quarantine still reads it; evicted after the inbox's TTL

    def _free_on_failure(self, ch: _Chunk) -> None:
        """Free ``ch``'s slot now, or quarantine it while a NIXL request or a peer may still touch it."""
        if ch.slot < 0 or ch.phase == "done":
            return
        handles = list(ch.handles)
        ch.handles = []
        event = ch.event  # a CUDA pack or unpack still touching the slot
        waits: list[tuple[str, tuple[int, ...]]] = []
        if ch.phase == "announced" and self.kind == "accept_push":
            waits.append(("landed", ch.peers))  # a P rank may still write into this slot
        if ch.phase == "served":
            waits.append(("chunk_pulled", ch.peers))  # a D rank may still read this slot

        def settled() -> bool:
            for h in list(handles):
                if self.agent.closed or self.agent.state(h) != "PROC":
                    try:
                        self.agent.release(h)
                    except Exception:  # noqa: BLE001,S110 - NIXL keeps what it cannot release
                        pass
                    handles.remove(h)
            if handles or (event is not None and not event.query()):
                return False
            for kind, peers in waits:
                told = self._chunk_args(kind, ch.index)
                aborted = {rank for rank, info in self.peers.items()
                           if info.agent in self.agent.senders("abort", self.request_id)}
                if not all(p in told or p in aborted for p in peers):
                    return False
            return True

        if not handles and not waits and event is None:
            self.buffer.release(ch.slot)
        else:
            self.buffer.quarantine(ch.slot, settled, self.grace_s)
        ch.phase = "done"

    def _finish(self) -> None:
        super()._finish()
        if self.result is not None:
            self.result = attrs.evolve(self.result, bytes_moved=self.wire.total_bytes, pack_s=self.pack_s,
                                       wire_s=self.wire_s, unpack_s=self.unpack_s, chunks=len(self.chunks))
        for kind in _KINDS:
            self.agent.drop(kind, self.request_id)


def _descs(base: int, offset: np.ndarray, nbytes: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((len(offset), 3), np.uint64)
    out[:, 0] = np.uint64(base) + offset.astype(np.uint64)
    out[:, 1] = nbytes.astype(np.uint64)
    out[:, 2] = device
    return out
