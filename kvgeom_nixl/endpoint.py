"""Endpoints, links and transfers: one rank's NIXL agent, its connection to a peer engine, and the
life of one request on it.

    Endpoint (one rank: agent + registered regions)
      .handshake() -> bytes ------------------------------------> peer's Endpoint.connect([...])
      .connect([payload of every peer rank]) -> Link (the Pair, built once per peer engine)

    Link on a D rank                        Link on a P rank
      .pull(id, request)   READ  <-----------  (P learns from the notification)  .serve_pull(id, request)
      .accept_push(id, request)  <-----------  WRITE + notification               .push(id, request)

    Transfer: posted -> landed -> receive steps (rearranges, zeros; D only) -> done
              any NIXL error, dead peer or deadline -> failed (TransferFailed; handles released)

Notifications carry the request id (``kvgeom1|pulled|<id>`` from a D rank to each P rank it read;
``kvgeom1|pushed|<id>`` from a P rank to each D rank it wrote); a P rank counts its consumers
(``plan.consumers()``) and a D rank waits for every P rank it reads from (``plan.sources_of``).
Give every attempt its own request id (a retry after a failure too): a notification that arrives
late from a failed attempt is kept until some transfer claims its id.
Nothing polls in the background: :meth:`Endpoint.progress` drains notifications and advances the
endpoint's in-flight transfers, and every wait loop calls it on its own endpoint and on the
in-process peers it is given.

Worked number: P TP2 -> D TP1 on 4 fresh blocks, HND, pull: D rank 0 posts 2 NIXL requests (one
per P rank); each P rank counts 1 consumer (``plan.consumers() == [1, 1]``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvgeom import (
    BlockList,
    Copies,
    EngineGeometry,
    InternalError,
    KvGeomError,
    Pair,
    PlanError,
    Request,
    TransferPlan,
    tile_bytes,
)
from kvgeom.lowering import TileTable, check_in_regions, tile_index_pairs, tile_rows, tile_table

from . import _nixl
from .errors import ExecutorError, HandshakeError, TransferFailed
from .handshake import ROLES, RankInfo, decode_rank, encode_rank
from .lowering import MODES, copy_descs, post_coalesced, post_prepped, table_descs
from .memory import RankMemory
from .receive import apply_receive_steps

__all__ = ["Endpoint", "Link", "Transfer", "TransferResult", "wait_all", "MAX_TABLE_TILES", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 30.0
MAX_TABLE_TILES = 1 << 24  # ~400 MB of Nx3 descriptors; NIXL indices are int32 anyway
_TAG = "kvgeom1"


def _notif(kind: str, request_id: str) -> bytes:
    return f"{_TAG}|{kind}|{request_id}".encode()


def _parse_notif(msg: bytes) -> tuple[str, str] | None:
    try:
        tag, kind, rid = msg.decode("utf-8").split("|", 2)
    except (UnicodeDecodeError, ValueError):
        return None
    return (kind, rid) if tag == _TAG else None


def _name(agent_result: Any) -> str:
    return agent_result.decode() if isinstance(agent_result, (bytes, bytearray)) else str(agent_result)


@attrs.frozen
class TransferResult:
    """What one rank did for one request.

    ``descriptors``: descriptors handed to NIXL (mode coalesced: plan copies; mode prepped: index
    pairs); ``nixl_descs``: NIXL's own count after merging (telemetry; ``None`` unless the
    endpoint was made with ``telemetry=True``).
    """

    request_id: str
    kind: str  # pull | push | accept_push | serve_pull
    role: str
    rank: int
    mode: str
    bytes_moved: int
    descriptors: int
    nixl_requests: int
    nixl_descs: int | None
    bytes_zeroed: int
    rearranges: int
    wall_s: float
    notes: tuple[str, ...] = ()


def _invalid_blocks(request: Request | None) -> dict[int, tuple[int, ...]]:
    if request is None:
        return {}
    out: dict[int, tuple[int, ...]] = {}
    for gi, g in enumerate(request.groups):
        side = g.decode
        out[gi] = tuple(side.block_ids) if isinstance(side, BlockList) else tuple(side.slot_ids)
    return out


class Transfer:
    """One request on one rank: poll it (non-blocking) or wait for it (bounded)."""

    def __init__(self, link: Link, kind: str, request_id: str, request: Request | None, plan: TransferPlan,
                 mode: str, timeout_s: float, *, notif_kind: str = "", expect: Iterable[str] = ()) -> None:
        self.link = link
        self.endpoint = link.endpoint
        self.kind = kind
        self.request_id = request_id
        self.request = request
        self.plan = plan
        self.mode = mode
        self.started = time.perf_counter()
        self.deadline = self.started + timeout_s
        self.timeout_s = timeout_s
        self.state = "posted"
        self.handles: list[Any] = []  # NIXL requests still to complete
        self.notif_kind = notif_kind  # passive sides: the notification kind they wait for
        self.expect: set[str] = set(expect)  # peer agents whose notification is still awaited
        self.event: Any = None
        self.failure: TransferFailed | None = None
        self.result: TransferResult | None = None
        self.bytes_moved = 0
        self.descriptors = 0
        self.nixl_requests = 0
        self.nixl_descs: int | None = 0 if self.endpoint.telemetry else None
        self.notes: list[str] = []

    # ---- public ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def settled(self) -> bool:
        return self.state in ("done", "failed")

    def poll(self) -> bool:
        """Advance; True once done. Raises :class:`TransferFailed` if the request failed."""
        self.endpoint.progress()
        if self.failure is not None:
            raise self.failure
        return self.done

    def wait(self, timeout_s: float | None = None, *, peers: Iterable[Endpoint] = ()) -> TransferResult:
        """Poll until done (also progressing in-process ``peers``); raises :class:`TransferFailed`."""
        if timeout_s is not None:
            self.deadline = min(self.deadline, time.perf_counter() + timeout_s)
        wait_all([self], peers=peers)
        if not (self.result is not None):
            raise InternalError("wait_all raised unless every transfer is done")
        return self.result

    def cancel(self, reason: str = "closed", detail: str = "cancelled") -> None:
        if not self.settled:
            self._fail(reason, detail)

    # ---- internals -------------------------------------------------------------------------
    def _fail(self, reason: str, detail: str) -> None:
        self._release()
        self.state = "failed"
        ep = self.endpoint
        blocks = _invalid_blocks(self.request) if ep.role == "decode" else {}
        self.failure = TransferFailed(self.request_id, reason, detail, invalid_blocks=blocks, kind=self.kind,
                                      role=ep.role, rank=ep.rank)
        if self.notif_kind:  # a late notification of this attempt must not complete a retry: use a new id
            ep._drop_notifs(self.notif_kind, self.request_id)
        ep._forget(self)

    def _release(self) -> None:
        for h in self.handles:
            try:
                h.release()
            except Exception as e:  # noqa: BLE001 - NIXL keeps an uncancellable handle in its leak list
                self.notes.append(f"release failed: {type(e).__name__}")
        self.handles = []

    def _advance(self) -> None:
        """One non-blocking step; never raises (failures are recorded)."""
        if self.settled:
            return
        try:
            self._step()
        except _nixl.nixl_errors() as e:
            self._fail(_nixl.classify(e), f"{type(e).__name__}: {e}")
            return
        except KvGeomError as e:
            self._fail("plan_error", f"{type(e).__name__}: {e}")
            return
        except (RuntimeError, IndexError) as e:  # torch errors in the receive steps, NIXL "ERR" states
            self._fail("receive_error" if self.state != "posted" else "nixl_error", f"{type(e).__name__}: {e}")
            return
        if not self.settled and time.perf_counter() > self.deadline:
            what = "NIXL requests" if self.handles else "notifications" if self.expect else "receive steps"
            self._fail("timeout", f"no completion after {self.timeout_s:.3g} s (waiting for {what})")

    def _step(self) -> None:
        ep = self.endpoint
        if self.state == "posted":
            still = []
            for h in self.handles:
                st = ep.agent.check_xfer_state(h)
                if st == "DONE":
                    if ep.telemetry and self.nixl_descs is not None:
                        self.nixl_descs += int(ep.agent.get_xfer_telemetry(h).descCount)
                    h.release()
                elif st == "PROC":
                    still.append(h)
                else:  # _fail releases every handle of self.handles (release is idempotent)
                    raise RuntimeError(f"NIXL reported {st} for a request")
            self.handles = still
            if self.expect:
                self.expect -= ep._senders(self.notif_kind, self.request_id)
            if not self.handles and not self.expect:
                if self.notif_kind:
                    ep._drop_notifs(self.notif_kind, self.request_id)
                self.state = "landed"
        if self.state == "landed":
            if ep.role == "decode":
                d_plan = self.plan.for_decode_rank(ep.rank)
                self.event = apply_receive_steps(ep.memory.byte_views(), d_plan.rearranges, d_plan.zeros,
                                                 stream=ep.stream())
            self.state = "receiving"
        if self.state == "receiving":
            if self.event is not None and not self.event.query():
                return
            self.event = None
            self._finish()

    def _finish(self) -> None:
        ep = self.endpoint
        zeros = rearr = 0
        if ep.role == "decode":
            d_plan = self.plan.for_decode_rank(ep.rank)
            zeros, rearr = d_plan.bytes_zeroed, len(d_plan.rearranges)
        self.state = "done"
        self.result = TransferResult(self.request_id, self.kind, ep.role, ep.rank, self.mode, self.bytes_moved,
                                     self.descriptors, self.nixl_requests, self.nixl_descs, zeros, rearr,
                                     time.perf_counter() - self.started, tuple(self.notes))
        ep._forget(self)


def wait_all(transfers: Sequence[Transfer], *, peers: Iterable[Endpoint] = ()) -> list[TransferResult]:
    """Drive ``transfers`` (and in-process ``peers``) until each is done or failed, each within its
    own deadline; then return their results or raise the first :class:`TransferFailed`."""
    endpoints: list[Endpoint] = []
    for ep in [t.endpoint for t in transfers] + list(peers):
        if all(ep is not e for e in endpoints):
            endpoints.append(ep)
    spins = 0
    while True:
        for ep in endpoints:
            ep.progress()
        if all(t.settled for t in transfers):
            break
        spins += 1
        if spins > 2000:  # after the first ~ms of tight polling, back off (another process may need the core)
            time.sleep(min(1e-3, 1e-5 * (spins - 2000)))
    for t in transfers:
        if t.failure is not None:
            raise t.failure
    return [t.result for t in transfers if t.result is not None]


class Link:
    """The local endpoint's connection to every rank of one peer engine; holds the :class:`Pair`."""

    def __init__(self, endpoint: Endpoint, peers: dict[int, RankInfo], pair: Pair) -> None:
        self.endpoint = endpoint
        self.peers = peers
        self.pair = pair
        self.peer_engine = next(iter(peers.values())).engine
        self._rank_of_agent = {info.agent: r for r, info in peers.items()}
        self._remote_tables: dict[tuple[int, int], Any] = {}  # (peer rank, tile) -> prepped handle
        self._tile: int | None = None
        self.closed = False

    @property
    def local_is_decode(self) -> bool:
        return self.endpoint.role == "decode"

    # ---- planning --------------------------------------------------------------------------
    def plan(self, request: Request, *, strategy: str = "direct") -> TransferPlan:
        """The plan for ``request`` on this pair (:func:`kvgeom.planning.plan_pair`)."""
        from kvgeom import plan_pair

        return plan_pair(self.pair, request, strategy=strategy)  # type: ignore[arg-type]

    @property
    def tile_bytes(self) -> int:
        if self._tile is None:
            self._tile = tile_bytes(self.pair)
        return self._tile

    # ---- initiators ------------------------------------------------------------------------
    def pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        """D rank: post READs of this rank's rows from every P rank it needs; returns at once."""
        self._require("decode", "pull")
        plan = self._plan(request, plan)
        t = Transfer(self, "pull", request_id, request, plan, self._mode(mode), timeout_s)
        copies = plan.for_decode_rank(self.endpoint.rank).copies
        self._post(t, copies, "READ", _notif("pulled", request_id))
        return t

    def push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        """P rank: post WRITEs of this rank's rows to every D rank that needs them; returns at once."""
        self._require("prefill", "push")
        plan = self._plan(request, plan)
        t = Transfer(self, "push", request_id, request, plan, self._mode(mode), timeout_s)
        copies = plan.for_prefill_rank(self.endpoint.rank)
        self._post(t, copies, "WRITE", _notif("pushed", request_id))
        return t

    # ---- passive sides ---------------------------------------------------------------------
    def accept_push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        """D rank: wait for the WRITE notification of every P rank this rank reads from, then run
        the receive steps."""
        self._require("decode", "accept_push")
        plan = self._plan(request, plan)
        expect = {self.peers[p].agent for p in plan.sources_of(self.endpoint.rank) if self._has(p)}
        t = Transfer(self, "accept_push", request_id, request, plan, "-", timeout_s, notif_kind="pushed",
                     expect=expect)
        d = plan.for_decode_rank(self.endpoint.rank)
        t.bytes_moved = d.bytes_copied
        self.endpoint._track(t)
        return t

    def serve_pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        """P rank: done when every D rank that reads from this rank (``plan.consumers()``) has said so."""
        self._require("prefill", "serve_pull")
        plan = self._plan(request, plan)
        p = self.endpoint.rank
        mine = plan.for_prefill_rank(p)
        consumers = {int(d) for d in np.unique(mine.d_rank)}
        if len(consumers) != int(plan.consumers()[p]):
            raise ExecutorError("plan.consumers", "the consumer count disagrees with the plan's rows",
                                actual=int(plan.consumers()[p]), expected=len(consumers))
        expect = {self.peers[d].agent for d in consumers if self._has(d)}
        t = Transfer(self, "serve_pull", request_id, request, plan, "-", timeout_s, notif_kind="pulled",
                     expect=expect)
        t.bytes_moved = mine.total_bytes
        self.endpoint._track(t)
        return t

    # ---- internals -------------------------------------------------------------------------
    def _has(self, rank: int) -> bool:
        if rank not in self.peers:
            raise ExecutorError("peer rank", f"the plan needs peer rank {rank}, which this link was not given",
                                actual=rank, expected=sorted(self.peers),
                                fix="connect with the handshake of every peer rank the plan uses")
        return True

    def _require(self, role: str, what: str) -> None:
        if self.closed or self.endpoint.closed:
            raise ExecutorError("link", f"{what} on a closed link", fix="connect again")
        if self.endpoint.role != role:
            raise ExecutorError("role", f"{what} runs on a {role} rank, this one is {self.endpoint.role}",
                                actual=self.endpoint.role, expected=role)

    def _mode(self, mode: str) -> str:
        if mode not in MODES:
            raise ExecutorError("mode", f"unknown lowering mode {mode!r}", actual=mode, expected=list(MODES))
        return mode

    def _plan(self, request: Request | None, plan: TransferPlan | None) -> TransferPlan:
        if plan is None:
            if request is None:
                raise ExecutorError("request", "pass the request (to plan it) or a plan",
                                    fix="link.pull(request_id, request)")
            plan = self.plan(request)
        if plan.prefill_tp != self.pair.prefill.tp or plan.decode_tp != self.pair.decode.tp:
            raise ExecutorError("plan", f"plan for TP{plan.prefill_tp}->TP{plan.decode_tp} on a "
                                f"TP{self.pair.prefill.tp}->TP{self.pair.decode.tp} pair",
                                actual=(plan.prefill_tp, plan.decode_tp),
                                expected=(self.pair.prefill.tp, self.pair.decode.tp))
        return plan

    def _sides(self, copies: Copies) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(peer rank, local region, local offset, peer region, peer offset) columns."""
        if self.local_is_decode:
            return copies.p_rank, copies.d_region, copies.d_offset, copies.p_region, copies.p_offset
        return copies.d_rank, copies.p_region, copies.p_offset, copies.d_region, copies.d_offset

    def _post(self, t: Transfer, copies: Copies, op: str, notif: bytes) -> None:
        ep = self.endpoint
        try:
            check_in_regions(copies, [r.nbytes for r in self.pair.prefill.regions],
                             [r.nbytes for r in self.pair.decode.regions])
            peer_col, lreg, loff, rreg, roff = self._sides(copies)
            peers = np.unique(peer_col).tolist()
            for peer in peers:  # every peer the rows need, before anything is posted
                self._has(peer)
            mode = t.mode
            tile_peer = p_idx = d_idx = None
            if mode == "prepped" and len(copies):
                try:
                    tables = (self._table(self.pair.prefill), self._table(self.pair.decode))
                    p_idx, d_idx = tile_index_pairs(copies, self.tile_bytes, p_table=tables[0], d_table=tables[1])
                    tile_peer = peer_col[tile_rows(copies, self.tile_bytes)]
                except PlanError as e:  # off the tile grid, or tables too large: per-request lists instead
                    t.notes.append(f"prepped mode unavailable ({e.message}); posted coalesced")
                    mode = "coalesced"
            for peer in peers:
                info = self.peers[peer]
                rows = np.flatnonzero(peer_col == peer)
                if mode == "coalesced":
                    local = copy_descs(ep.memory.bases, ep.memory.devices, lreg[rows], loff[rows],
                                       copies.nbytes[rows])
                    remote = copy_descs(info.bases, info.devices, rreg[rows], roff[rows], copies.nbytes[rows])
                    h = post_coalesced(ep.agent, op, local, ep.memory.mem_type, remote, info.mem_type, info.agent,
                                       notif)
                    t.descriptors += len(rows)
                else:
                    if not (p_idx is not None and d_idx is not None):
                        raise InternalError("set above for mode prepped")
                    sel = tile_peer == peer
                    li, ri = (d_idx[sel], p_idx[sel]) if self.local_is_decode else (p_idx[sel], d_idx[sel])
                    h = post_prepped(ep.agent, op, ep._local_table(self.tile_bytes)[1], li,
                                     self._remote_table(peer), ri, notif)
                    t.descriptors += len(li)
                t.handles.append(h)
                t.nixl_requests += 1
                t.bytes_moved += int(copies.nbytes[rows].sum())
                state = ep.agent.transfer(h)
                if state == "ERR":
                    raise RuntimeError("NIXL refused to post the request")
            if mode != t.mode:
                t.mode = mode
        except _nixl.nixl_errors() as e:
            t._fail(_nixl.classify(e), f"posting: {type(e).__name__}: {e}")
            return
        except (PlanError, RuntimeError, KeyError) as e:
            t._fail("plan_error" if isinstance(e, PlanError) else "nixl_error", f"posting: {type(e).__name__}: {e}")
            return
        except BaseException:  # e.g. ExecutorError for a peer the link lacks: release what was posted
            t._release()
            raise
        ep._track(t)

    def _table(self, engine: EngineGeometry) -> TileTable:
        table = tile_table(engine, self.tile_bytes)
        if table.num_tiles > MAX_TABLE_TILES:
            raise PlanError("tile table", f"{table.num_tiles} tiles of {self.tile_bytes} B for one rank",
                            actual=table.num_tiles, expected=f"<= {MAX_TABLE_TILES}",
                            fix="use mode 'coalesced' for this pair")
        return table

    def _remote_table(self, peer: int) -> Any:
        key = (peer, self.tile_bytes)
        h = self._remote_tables.get(key)
        if h is None:
            info = self.peers[peer]
            descs = table_descs(info.bases, info.devices, self._table(info.engine))
            h = self.endpoint.agent.prep_xfer_dlist(info.agent, descs, info.mem_type)
            self._remote_tables[key] = h
        return h

    def close(self) -> None:
        """Release the prepared peer tables and forget the peer agents."""
        if self.closed:
            return
        self.closed = True
        for h in self._remote_tables.values():
            try:
                h.release()
            except Exception:  # noqa: BLE001,S110 - best effort at teardown
                pass
        self._remote_tables.clear()
        ep = self.endpoint
        for info in self.peers.values():
            try:
                ep.agent.remove_remote_agent(info.agent)
            except Exception:  # noqa: BLE001,S110 - the peer may already be gone
                pass
        if self in ep._links:
            ep._links.remove(self)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Endpoint:
    """One rank of one engine: a NIXL agent and the rank's regions, registered once.

    ``regions`` are the caller's buffers in the geometry's region order: torch tensors (CPU ->
    DRAM, CUDA -> VRAM), numpy arrays, or ``(pointer, nbytes)`` (``mem_type``/``device`` then say
    where). They are kept referenced, never copied, until :meth:`close`.
    """

    def __init__(self, engine: EngineGeometry, role: str, rank: int, regions: Sequence[Any], *,
                 agent_name: str | None = None, mem_type: str | None = None, device: int | None = None,
                 telemetry: bool = False, progress_thread: bool = False) -> None:
        if role not in ROLES:
            raise ExecutorError("role", f"unknown role {role!r}", actual=role, expected=list(ROLES))
        if not 0 <= rank < engine.tp:
            raise ExecutorError("rank", f"rank {rank} outside tp={engine.tp}", actual=rank,
                                expected=f"0 <= rank < {engine.tp}")
        self.engine = engine
        self.role = role
        self.rank = rank
        self.memory = RankMemory(engine, regions, mem_type=mem_type, device=device)
        self.telemetry = telemetry
        self.name = agent_name or f"kvgeom-{role}-{rank}-{uuid.uuid4().hex[:12]}"
        self.closed = False
        self._links: list[Link] = []
        self._inflight: list[Transfer] = []
        self._inbox: dict[tuple[str, str], set[str]] = {}
        self._tables: dict[int, tuple[TileTable, Any]] = {}
        self._stream: Any = None
        self.agent = _nixl.make_agent(self.name, telemetry=telemetry, progress_thread=progress_thread)
        try:
            self._reg = self.agent.register_memory(self.memory.descs(), self.memory.mem_type)
        except _nixl.nixl_errors() as e:
            self.agent = None
            raise ExecutorError("regions", f"NIXL refused to register the regions: {type(e).__name__}: {e}",
                                fix="check the memory type (a host pointer cannot be VRAM)") from e

    # ---- handshake -------------------------------------------------------------------------
    def info(self) -> RankInfo:
        self._open()
        regions = tuple((r.addr, r.nbytes, r.device) for r in self.memory.regions)
        return RankInfo(self.engine, self.role, self.rank, self.name, self.memory.mem_type, regions,
                        bytes(self.agent.get_agent_metadata()))

    def handshake(self) -> bytes:
        """This rank's payload for the peer engine's :meth:`connect`."""
        return encode_rank(self.info())

    def connect(self, payloads: Iterable[bytes | str | RankInfo]) -> Link:
        """Validate the peer engine's payloads (one per peer rank it will use), load their NIXL
        metadata and build the :class:`Pair` once. Raises :class:`HandshakeError` or
        :class:`~kvgeom.errors.IncompatibleGeometry` before anything is loaded."""
        self._open()
        infos = [p if isinstance(p, RankInfo) else decode_rank(p) for p in payloads]
        if not infos:
            raise HandshakeError("payloads", "no peer payloads given", expected="one per peer rank")
        other = "prefill" if self.role == "decode" else "decode"
        first = infos[0]
        peers: dict[int, RankInfo] = {}
        for i, info in enumerate(infos):
            if info.role != other:
                raise HandshakeError(f"payloads[{i}].role", f"a {self.role} rank connects to {other} ranks, "
                                     f"got {info.role}", actual=info.role, expected=other)
            if info.engine != first.engine:
                raise HandshakeError(f"payloads[{i}].engine", "peer ranks advertise different geometries",
                                     actual=info.engine.summary(), expected=first.engine.summary(),
                                     fix="every rank of an engine shares one geometry")
            if info.rank in peers:
                raise HandshakeError(f"payloads[{i}].rank", f"rank {info.rank} appears twice", actual=info.rank)
            peers[info.rank] = info
        pair = Pair(first.engine, self.engine) if self.role == "decode" else Pair(self.engine, first.engine)
        loaded: list[str] = []
        try:
            for info in peers.values():
                name = _name(self.agent.add_remote_agent(info.metadata))
                loaded.append(name)
                if name != info.agent:
                    raise HandshakeError(f"payloads[rank {info.rank}].agent", f"the NIXL metadata is agent {name!r}, "
                                         f"the payload says {info.agent!r}", actual=name, expected=info.agent)
        except _nixl.nixl_errors() as e:
            self._unload(loaded)
            raise HandshakeError("nixl_metadata", f"NIXL refused the metadata: {type(e).__name__}: {e}") from e
        except HandshakeError:
            self._unload(loaded)
            raise
        link = Link(self, peers, pair)
        self._links.append(link)
        return link

    def _unload(self, names: list[str]) -> None:
        for n in names:
            try:
                self.agent.remove_remote_agent(n)
            except Exception:  # noqa: BLE001,S110 - best effort
                pass

    # ---- progress --------------------------------------------------------------------------
    def progress(self) -> None:
        """Drain notifications and advance every in-flight transfer of this rank (non-blocking)."""
        if self.closed:
            return
        try:
            notifs = self.agent.get_new_notifs()
        except _nixl.nixl_errors():
            notifs = {}
        for sender, msgs in notifs.items():
            for m in msgs:
                parsed = _parse_notif(bytes(m))
                if parsed is not None:
                    self._inbox.setdefault(parsed, set()).add(_name(sender))
        for t in list(self._inflight):
            t._advance()

    def _senders(self, kind: str, request_id: str) -> set[str]:
        return self._inbox.get((kind, request_id), set())

    def _drop_notifs(self, kind: str, request_id: str) -> None:
        self._inbox.pop((kind, request_id), None)

    def pending_notifications(self) -> dict[tuple[str, str], set[str]]:
        """Notifications received for requests no transfer has claimed yet."""
        return {k: set(v) for k, v in self._inbox.items()}

    def _track(self, t: Transfer) -> None:
        if not t.settled:
            self._inflight.append(t)

    def _forget(self, t: Transfer) -> None:
        if t in self._inflight:
            self._inflight.remove(t)

    # ---- tables and streams -----------------------------------------------------------------
    def _local_table(self, tile: int) -> tuple[TileTable, Any]:
        got = self._tables.get(tile)
        if got is None:
            table = tile_table(self.engine, tile)
            if table.num_tiles > MAX_TABLE_TILES:
                raise PlanError("tile table", f"{table.num_tiles} tiles of {tile} B for one rank",
                                actual=table.num_tiles, expected=f"<= {MAX_TABLE_TILES}",
                                fix="use mode 'coalesced' for this pair")
            descs = table_descs(self.memory.bases, self.memory.devices, table)
            got = (table, self.agent.prep_xfer_dlist("", descs, self.memory.mem_type))
            self._tables[tile] = got
        return got

    def stream(self) -> Any:
        """The CUDA stream receive steps run on (``None`` for host memory)."""
        if self.memory.mem_type != "VRAM":
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self.memory.device())
        return self._stream

    # ---- teardown --------------------------------------------------------------------------
    def _open(self) -> None:
        if self.closed:
            raise ExecutorError("endpoint", f"endpoint {self.name} is closed", fix="make a new Endpoint")

    def close(self) -> None:
        """Fail in-flight transfers, release every handle, deregister, drop the buffers."""
        if self.closed:
            return
        for t in list(self._inflight):
            t.cancel("closed", "endpoint closed")
        for link in list(self._links):
            link.close()
        for _, h in self._tables.values():
            try:
                h.release()
            except Exception:  # noqa: BLE001,S110 - best effort at teardown
                pass
        self._tables.clear()
        if self.agent is not None:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001,S110 - best effort at teardown
                pass
        self.closed = True
        self._reg = None
        self.agent = None
        self.memory.release()
        self._inbox.clear()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._links)} links, {len(self._inflight)} in flight"
        return f"Endpoint({self.name}: {self.engine.name} {self.role} rank {self.rank}/{self.engine.tp}, {state})"

