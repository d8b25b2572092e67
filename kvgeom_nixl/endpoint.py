"""Endpoints and links: one rank of one engine, and its connection to every rank of a peer engine.

    Endpoint (one rank: a RankAgent + the registered regions)
      .handshake() -> bytes ------------------------------------> peer's Endpoint.connect([...])
      .connect([payload of every peer rank]) -> Link (the Pair, built once per peer engine)

    Link on a D rank                        Link on a P rank
      .pull(id, request)   READ  <-----------  (P learns from the notification)  .serve_pull(id, request)
      .accept_push(id, request)  <-----------  WRITE + notification               .push(id, request)

One pull, top-down: ``Link.pull`` plans (or takes the plan), makes a :class:`Transfer`, lowers
this rank's copies to one NIXL request per P rank (:meth:`Link._post`: coalesced descriptor lists
or prepared-table indices, :mod:`kvgeom_nixl.lowering`), posts them through the endpoint's
:class:`~kvgeom_nixl.agent.RankAgent` and hands the transfer to the endpoint. Then every
:meth:`Endpoint.progress` drains the agent's notifications and advances each in-flight transfer
one step (:mod:`kvgeom_nixl.transfer`: posted -> landed -> receive steps -> done, or failed).

Notifications carry the request id (``kvgeom1|pulled|<id>`` from a D rank to each P rank it read;
``kvgeom1|pushed|<id>`` from a P rank to each D rank it wrote); a P rank counts its consumers
(``plan.consumers()``) and a D rank waits for every P rank it reads from (``plan.sources_of``).
Give every attempt its own request id (a retry after a failure too): a notification that arrives
late from a failed attempt is kept until some transfer claims its id. Nothing polls in the
background: every wait loop calls ``progress()`` on its own endpoint and on the in-process peers
it is given. The contract (registration, handshake, failure and invalid blocks) is
docs/design.md §8; every copy is checked to stay in its regions before posting
(docs/design.md §4.2 (invariant 1)).

Worked number: P TP2 -> D TP1 on 4 fresh blocks, HND, pull: D rank 0 posts 2 NIXL requests (one
per P rank); each P rank counts 1 consumer (``plan.consumers() == [1, 1]``).

With pipeline stages, DCP and replicas (docs/design.md §11) ranks are flat: a D rank connects to
the handshakes of every P rank of every stage, posts requests only to the P ranks its rows name
(those holding its layers and tokens), and a P rank pushes only its stage's layers. For P PP2 x
TP1 -> D TP2 each D rank posts 2 requests, one per P stage.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvgeom import (
    Copies,
    EngineGeometry,
    Pair,
    PlanError,
    Rearrange,
    Request,
    TransferPlan,
    Zeros,
    plan_pair,
    tile_bytes,
)
from kvgeom.lowering import check_in_regions, tile_index_blocks, tile_index_pairs
from kvgeom.values import CopyBlock

from .agent import RankAgent, classify, nixl_errors, notification
from .errors import ExecutorError, HandshakeError
from .handshake import ROLES, RankInfo, decode_rank, encode_rank
from .lowering import MAX_TABLE_TILES, MODES, capped_table, copy_descs, table_descs
from .memory import RankMemory
from .packed import DEFAULT_GRACE_S, PackedTransfer
from .receive import apply_receive_steps
from .staging import DEFAULT_SLOTS, StagingBuffer, run_steps
from .transfer import Transfer, TransferResult, wait_all

__all__ = ["Endpoint", "Link", "Transfer", "TransferResult", "wait_all", "MAX_TABLE_TILES", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 30.0
RANK_STRATEGIES = ("direct", "staged")  # planned per rank on the compiled pair when a link plans itself


class Endpoint:
    """One rank of one engine: a NIXL agent and the rank's regions, registered once.

    ``regions`` are the caller's buffers in the geometry's region order: torch tensors (CPU ->
    DRAM, CUDA -> VRAM), numpy arrays, or ``(pointer, nbytes)`` (``mem_type``/``device`` then say
    where). They are kept referenced, never copied, until :meth:`close`. ``rank_agent`` is the
    :class:`~kvgeom_nixl.agent.RankAgent`; ``agent`` the bare NIXL agent (``None`` once closed).
    """

    def __init__(self, engine: EngineGeometry, role: str, rank: int, regions: Sequence[Any], *,
                 agent_name: str | None = None, mem_type: str | None = None, device: int | None = None,
                 telemetry: bool = False, progress_thread: bool = False, staging_bytes: int = 0,
                 staging_slots: int = DEFAULT_SLOTS, staging_grace_s: float = DEFAULT_GRACE_S) -> None:
        if role not in ROLES:
            raise ExecutorError("role", f"unknown role {role!r}", actual=role, expected=list(ROLES))
        if not 0 <= rank < engine.num_ranks:
            what = f"tp={engine.tp}" if engine.topology.trivial else f"the engine's {engine.num_ranks} ranks"
            raise ExecutorError("rank", f"rank {rank} outside {what}", actual=rank,
                                expected=f"0 <= rank < {engine.num_ranks}")
        self.engine = engine
        self.role = role
        self.rank = rank
        self.memory = RankMemory(engine, regions, mem_type=mem_type, device=device, rank=rank)
        self.telemetry = telemetry
        self.name = agent_name or f"kvgeom-{role}-{rank}-{uuid.uuid4().hex[:12]}"
        self.closed = False
        self._links: list[Link] = []
        self._inflight: list[Transfer] = []
        self._stream: Any = None
        # packed plans (docs/design.md §12.5): one staging ring on the cache's device, registered with the regions
        self.staging = StagingBuffer(self.memory, staging_bytes, staging_slots) if staging_bytes else None
        self.staging_grace_s = staging_grace_s
        descs = self.memory.descs()
        if self.staging is not None:
            descs = np.concatenate([descs, np.array([self.staging.desc()], np.uint64)])
        self.rank_agent = RankAgent(self.name, descs, self.memory.mem_type, telemetry=telemetry,
                                    progress_thread=progress_thread)

    @property
    def agent(self) -> Any:
        """The bare NIXL agent (``None`` once closed)."""
        return self.rank_agent.nixl

    # ---- handshake -------------------------------------------------------------------------
    def info(self) -> RankInfo:
        self._open()
        regions = tuple((r.addr, r.nbytes, r.device) for r in self.memory.regions)
        st = self.staging
        staging = None if st is None else (st.addr, st.nbytes, st.device_id, st.slot_bytes, st.slots)
        return RankInfo(self.engine, self.role, self.rank, self.name, self.memory.mem_type, regions,
                        self.rank_agent.metadata(), staging)

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
        self._load(peers)
        link = Link(self, peers, pair)
        self._links = [lk for lk in self._links if not lk.closed] + [link]
        return link

    def _load(self, peers: dict[int, RankInfo]) -> None:
        """Load every peer's NIXL metadata, or none of it (a refusal unloads what was loaded)."""
        loaded: list[str] = []
        try:
            for info in peers.values():
                name = self.rank_agent.add_peer(info.metadata)
                loaded.append(name)
                if name != info.agent:
                    raise HandshakeError(f"payloads[rank {info.rank}].agent", f"the NIXL metadata is agent {name!r}, "
                                         f"the payload says {info.agent!r}", actual=name, expected=info.agent)
        except nixl_errors() as e:
            self._unload(loaded)
            raise HandshakeError("nixl_metadata", f"NIXL refused the metadata: {type(e).__name__}: {e}") from e
        except HandshakeError:
            self._unload(loaded)
            raise

    def _unload(self, names: list[str]) -> None:
        for n in names:
            self.rank_agent.remove_peer(n)

    # ---- transfers -------------------------------------------------------------------------
    def track(self, transfer: Transfer) -> Transfer:
        """Advance ``transfer`` in every :meth:`progress` until it settles; returns it."""
        if not transfer.settled:
            self._inflight.append(transfer)
        return transfer

    @property
    def in_flight(self) -> tuple[Transfer, ...]:
        """The transfers of this rank not yet done or failed."""
        return tuple(t for t in self._inflight if not t.settled)

    def progress(self) -> None:
        """Drain notifications and advance every in-flight transfer of this rank (non-blocking)."""
        if self.closed:
            return
        self.rank_agent.drain()
        for t in list(self._inflight):
            t.advance()
        self._inflight = [t for t in self._inflight if not t.settled]

    def pending_notifications(self) -> dict[tuple[str, str], set[str]]:
        """Notifications received for requests no transfer has claimed yet."""
        return self.rank_agent.pending()

    def receive(self, rearranges: Sequence[Rearrange], zeros: Zeros) -> Any:
        """Run receive steps on this rank's regions (on :meth:`stream` for VRAM): a CUDA event to
        wait for, or ``None`` once done (host memory)."""
        return apply_receive_steps(self.memory.byte_views(), rearranges, zeros, stream=self.stream())

    def run_staged(self, steps: Sequence[Any], slot: int, pack: bool) -> Any:
        """Pack steps into (``pack``) or unpack steps out of staging ``slot`` on this rank's regions
        (on :meth:`stream` for VRAM): a CUDA event to wait for, or ``None`` once done."""
        if self.staging is None:
            raise ExecutorError("staging", "this endpoint has no staging buffer", fix="pass staging_bytes")
        stream = self.stream()
        if stream is None:
            run_steps(steps, self.memory.byte_views(), self.staging, slot, pack=pack)
            return None
        import torch

        with torch.cuda.stream(stream):
            run_steps(steps, self.memory.byte_views(), self.staging, slot, pack=pack)
            event = torch.cuda.Event()
            event.record(stream)
        return event

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
        self._inflight = []
        for link in self._links:
            link.close()
        self._links = []
        self.rank_agent.close()
        self.closed = True
        self.memory.release()
        self.staging = None

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        links = sum(not lk.closed for lk in self._links)
        state = "closed" if self.closed else f"{links} links, {len(self.in_flight)} in flight"
        return f"Endpoint({self.name}: {self.engine.name} {self.role} rank {self.rank}/{self.engine.num_ranks}, {state})"


class Link:
    """The local endpoint's connection to every rank of one peer engine; holds the :class:`Pair`."""

    def __init__(self, endpoint: Endpoint, peers: dict[int, RankInfo], pair: Pair) -> None:
        self.endpoint = endpoint
        self.peers = peers
        self.pair = pair
        self.peer_engine = next(iter(peers.values())).engine
        self._tile: int | None = None
        self.closed = False

    @property
    def local_is_decode(self) -> bool:
        return self.endpoint.role == "decode"

    # ---- planning --------------------------------------------------------------------------
    def plan(self, request: Request, *, strategy: str = "direct") -> TransferPlan:
        """The plan for ``request`` on this pair (:func:`kvgeom.planning.plan_pair`); packed and auto
        plans use :attr:`staging_bytes` as the chunk capacity, so without staging on both sides auto
        never picks packed and packed raises :class:`~kvgeom.errors.StagingCapacityError`."""
        return plan_pair(self.pair, request, strategy=strategy,  # type: ignore[arg-type]
                         staging_bytes=self.staging_bytes)

    @property
    def staging_bytes(self) -> int:
        """The slot size both sides have (0 when either has no staging buffer): what a packed plan's
        busiest chunk may stage on one rank."""
        own = self.endpoint.staging
        sizes = [info.staging[3] if info.staging is not None else 0 for info in self.peers.values()]
        return min([own.slot_bytes if own is not None else 0] + sizes)

    def rank_plan(self, request: Request, *, strategy: str = "direct") -> TransferPlan:
        """What this rank posts and applies for ``request``, planned on the compiled pair for this
        rank only (``plan.for_decode_rank(rank)`` on D, ``plan.for_prefill_rank(rank)``'s copies on
        P; docs/design.md §13.4). The pair compiles on the link's first request."""
        rank = self.endpoint.rank
        compiled = self.pair.compile()
        if self.local_is_decode:
            return compiled.plan(request, strategy=strategy, decode_rank=rank)  # type: ignore[arg-type]
        return compiled.plan(request, strategy=strategy, prefill_rank=rank)  # type: ignore[arg-type]

    def _rank_blocks(self, request: Request, strategy: str) -> tuple[CopyBlock, ...]:
        """This rank's copies for ``request`` as outer-sum blocks (the prepped fast path: tile
        indices straight from them, no byte columns)."""
        rank = self.endpoint.rank
        compiled = self.pair.compile()
        if self.local_is_decode:
            return compiled.copy_blocks(request, strategy=strategy, decode_rank=rank)  # type: ignore[arg-type]
        return compiled.copy_blocks(request, strategy=strategy, prefill_rank=rank)  # type: ignore[arg-type]

    @property
    def tile_bytes(self) -> int:
        if self._tile is None:
            self._tile = tile_bytes(self.pair)
        return self._tile

    # ---- initiators ------------------------------------------------------------------------
    def pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct") -> Transfer:
        """D rank: post READs of this rank's rows from every P rank it needs; returns at once (a
        packed plan announces its first slots and pulls chunk by chunk, docs/design.md §12.5)."""
        self._require("decode", "pull")
        blocks = self._blocks_for(request, plan, mode, strategy)
        plan = self._plan(request, plan, strategy)
        if plan.packed:
            return self._packed("pull", request_id, request, plan, mode, timeout_s)
        t = self._transfer("pull", request_id, request, plan, self._mode(mode), timeout_s)
        self._post(t, plan.for_decode_rank(self.endpoint.rank).copies, "READ", notification("pulled", request_id),
                   blocks)
        return self.endpoint.track(t)

    def push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct") -> Transfer:
        """P rank: post WRITEs of this rank's rows to every D rank that needs them; returns at once (a
        packed plan packs and writes each chunk once its D ranks have announced their slots)."""
        self._require("prefill", "push")
        blocks = self._blocks_for(request, plan, mode, strategy)
        plan = self._plan(request, plan, strategy)
        if plan.packed:
            return self._packed("push", request_id, request, plan, mode, timeout_s)
        t = self._transfer("push", request_id, request, plan, self._mode(mode), timeout_s)
        self._post(t, plan.for_prefill_rank(self.endpoint.rank), "WRITE", notification("pushed", request_id), blocks)
        return self.endpoint.track(t)

    def _blocks_for(self, request: Request | None, plan: TransferPlan | None, mode: str,
                    strategy: str) -> tuple[CopyBlock, ...] | None:
        """The prepped fast path's blocks: only when this link plans the request itself, for its rank."""
        if mode != "prepped" or plan is not None or request is None or strategy not in RANK_STRATEGIES:
            return None
        return self._rank_blocks(request, strategy)

    # ---- passive sides ---------------------------------------------------------------------
    def accept_push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct") -> Transfer:
        """D rank: wait for the WRITE notification of every P rank this rank reads from, then run
        the receive steps (packed: announce slots, unpack each chunk as it lands)."""
        self._require("decode", "accept_push")
        plan = self._plan(request, plan, strategy)
        if plan.packed:
            return self._packed("accept_push", request_id, request, plan, "coalesced", timeout_s)
        rank = self.endpoint.rank
        expect = {self._peer(p).agent for p in plan.sources_of(rank)}
        t = self._transfer("accept_push", request_id, request, plan, "-", timeout_s, notif_kind="pushed",
                           expect=expect, bytes_moved=plan.for_decode_rank(rank).bytes_copied)
        return self.endpoint.track(t)

    def serve_pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct") -> Transfer:
        """P rank: done when every D rank that reads from this rank (``plan.consumers()``) has said so
        (packed: pack each chunk once its D ranks have announced their slots)."""
        self._require("prefill", "serve_pull")
        plan = self._plan(request, plan, strategy)
        if plan.packed:
            return self._packed("serve_pull", request_id, request, plan, "coalesced", timeout_s)
        p = self.endpoint.rank
        mine = plan.for_prefill_rank(p)
        consumers = {int(d) for d in np.unique(mine.d_rank)}
        if len(consumers) != int(plan.consumers()[p]):
            raise ExecutorError("plan.consumers", "the consumer count disagrees with the plan's rows",
                                actual=int(plan.consumers()[p]), expected=len(consumers))
        expect = {self._peer(d).agent for d in consumers}
        t = self._transfer("serve_pull", request_id, request, plan, "-", timeout_s, notif_kind="pulled",
                           expect=expect, bytes_moved=mine.total_bytes)
        return self.endpoint.track(t)

    # ---- one request -----------------------------------------------------------------------
    def _packed(self, kind: str, request_id: str, request: Request | None, plan: TransferPlan, mode: str,
                timeout_s: float) -> Transfer:
        """A packed request (docs/design.md §12.5); a plan this pair cannot run raises before anything moves."""
        ep = self.endpoint
        mode = self._mode(mode)
        if ep.staging is None:
            raise ExecutorError("staging", f"a packed plan needs a staging buffer on {ep.name}",
                                fix="create the endpoint with staging_bytes >= the plan's busiest chunk")
        if len(plan.copies) or plan.rearranges:
            raise ExecutorError("plan", "a packed plan with copies or rearranges (mixed plans are not executed)",
                                actual=(len(plan.copies), len(plan.rearranges)), expected=(0, 0))
        peer_col = plan.wire.p_rank if self.local_is_decode else plan.wire.d_rank
        own_col = plan.wire.d_rank if self.local_is_decode else plan.wire.p_rank
        peers = {int(p): self._peer(int(p)) for p in np.unique(peer_col[own_col == ep.rank])}
        t = PackedTransfer(ep, ep.rank_agent, kind, request_id, request, plan, timeout_s, role=ep.role, rank=ep.rank,
                           buffer=ep.staging, peers=peers, run_steps=ep.run_staged,
                           receive=ep.receive if self.local_is_decode else None, grace_s=ep.staging_grace_s)
        if mode == "prepped":
            t.fall_back("coalesced", "packed plans post their wire rows as coalesced lists")
        try:
            t.check_fit()
        except PlanError as e:
            t.fail("plan_error", f"{type(e).__name__}: {e}")
        return ep.track(t)

    def _transfer(self, kind: str, request_id: str, request: Request | None, plan: TransferPlan, mode: str,
                  timeout_s: float, *, notif_kind: str = "", expect: Iterable[str] = (),
                  bytes_moved: int = 0) -> Transfer:
        ep = self.endpoint
        return Transfer(ep, ep.rank_agent, kind, request_id, request, plan, mode, timeout_s, role=ep.role,
                        rank=ep.rank, notif_kind=notif_kind, expect=expect, bytes_moved=bytes_moved,
                        receive=ep.receive if self.local_is_decode else None)

    def _post(self, t: Transfer, copies: Copies, op: str, notif: bytes,
              blocks: tuple[CopyBlock, ...] | None = None) -> None:
        """Lower this rank's ``copies`` to one NIXL request per peer rank and post them.

        Every row is checked against the regions the two ranks hold (a region of another pipeline
        stage has 0 bytes there, docs/design.md §11.4) before anything is posted. A bad plan or a
        NIXL refusal fails ``t`` (what was posted is released); a plan that needs a peer rank this
        link was not given raises :class:`ExecutorError` before anything is posted.
        """
        agent = self.endpoint.rank_agent
        try:
            peer_col, lreg, loff, rreg, roff = self._sides(copies)
            peers = [self._peer(int(p)) for p in np.unique(peer_col)]  # every peer the rows need, first
            rows_of = {info.rank: np.flatnonzero(peer_col == info.rank) for info in peers}
            for info in peers:
                mine = copies.take(rows_of[info.rank])
                if self.local_is_decode:
                    check_in_regions(mine, info.sizes, self.endpoint.memory.sizes)
                else:
                    check_in_regions(mine, self.endpoint.memory.sizes, info.sizes)
            prepped = self._tile_indices(t, copies, rows_of, blocks) if t.mode == "prepped" and len(copies) else None
            for info in peers:
                rows = rows_of[info.rank]
                nbytes = int(copies.nbytes[rows].sum())
                if prepped is None:
                    local = copy_descs(self.endpoint.memory.bases, self.endpoint.memory.devices, lreg[rows],
                                       loff[rows], copies.nbytes[rows])
                    remote = copy_descs(info.bases, info.devices, rreg[rows], roff[rows], copies.nbytes[rows])
                    h = agent.post_coalesced(op, local, remote, info.mem_type, info.agent, notif)
                    t.add_request(h, descriptors=len(rows), nbytes=nbytes)
                else:
                    local_idx, remote_idx = prepped[info.rank]
                    h = agent.post_prepped(op, self._local_table(), local_idx, self._remote_table(info),
                                           remote_idx, notif)
                    t.add_request(h, descriptors=len(local_idx), nbytes=nbytes)
        except nixl_errors() as e:
            t.fail(classify(e), f"posting: {type(e).__name__}: {e}")
        except (PlanError, RuntimeError, KeyError) as e:
            t.fail("plan_error" if isinstance(e, PlanError) else "nixl_error", f"posting: {type(e).__name__}: {e}")
        except BaseException:  # e.g. ExecutorError for a peer the link lacks: release what was posted
            t.cancel("closed", "posting interrupted")
            raise

    def _sides(self, copies: Copies) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(peer rank, local region, local offset, peer region, peer offset) columns."""
        if self.local_is_decode:
            return copies.p_rank, copies.d_region, copies.d_offset, copies.p_region, copies.p_offset
        return copies.d_rank, copies.p_region, copies.p_offset, copies.d_region, copies.d_offset

    def _tile_indices(self, t: Transfer, copies: Copies, rows_of: dict[int, np.ndarray],
                      blocks: tuple[CopyBlock, ...] | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
        """Mode prepped: per peer rank, (local indices, peer indices) into the two ranks' tables, or
        ``None`` (``t`` falls back to coalesced) when the plan is off the tile grid or a table is
        too large. Each rank's table has tiles only for the regions it holds. With ``blocks`` (the
        compiled pair's rows of this rank) the indices come straight from them
        (:func:`kvgeom.lowering.tile_index_blocks`), not from the byte columns."""
        tile = self.tile_bytes
        me = self.endpoint.rank
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        try:
            if blocks is not None:
                pair = self.pair
                got = tile_index_blocks(blocks, tile, p_tables=lambda r: capped_table(pair.prefill, tile, r),
                                        d_tables=lambda r: capped_table(pair.decode, tile, r))
                for (p_rank, d_rank), (p_idx, d_idx) in got.items():
                    peer = p_rank if self.local_is_decode else d_rank
                    out[peer] = (d_idx, p_idx) if self.local_is_decode else (p_idx, d_idx)
                if set(out) != set(rows_of):
                    raise PlanError("blocks", "the blocks and the plan's copies name different peers",
                                    actual=sorted(out), expected=sorted(rows_of))
                return out
            for peer, rows in rows_of.items():
                p_rank, d_rank = (peer, me) if self.local_is_decode else (me, peer)
                p_idx, d_idx = tile_index_pairs(copies.take(rows), tile,
                                                p_table=capped_table(self.pair.prefill, tile, p_rank),
                                                d_table=capped_table(self.pair.decode, tile, d_rank))
                out[peer] = (d_idx, p_idx) if self.local_is_decode else (p_idx, d_idx)
        except PlanError as e:
            t.fall_back("coalesced", e.message)
            return None
        return out

    def _local_table(self) -> Any:
        """This rank's prepared table (shared by every link of the endpoint)."""
        mem = self.endpoint.memory
        return self._prepared("", self.endpoint.engine, self.endpoint.rank, mem.bases, mem.devices, mem.mem_type)

    def _remote_table(self, info: RankInfo) -> Any:
        return self._prepared(info.agent, info.engine, info.rank, info.bases, info.devices, info.mem_type)

    def _prepared(self, agent_name: str, engine: EngineGeometry, rank: int, bases: np.ndarray, devices: np.ndarray,
                  mem_type: str) -> Any:
        agent = self.endpoint.rank_agent
        handle = agent.prepared(agent_name, self.tile_bytes)
        if handle is None:
            descs = table_descs(bases, devices, capped_table(engine, self.tile_bytes, rank))
            handle = agent.prepare(agent_name, self.tile_bytes, descs, mem_type)
        return handle

    # ---- checks ----------------------------------------------------------------------------
    def _peer(self, rank: int) -> RankInfo:
        if rank not in self.peers:
            raise ExecutorError("peer rank", f"the plan needs peer rank {rank}, which this link was not given",
                                actual=rank, expected=sorted(self.peers),
                                fix="connect with the handshake of every peer rank the plan uses")
        return self.peers[rank]

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

    def _plan(self, request: Request | None, plan: TransferPlan | None, strategy: str = "direct") -> TransferPlan:
        if plan is None:
            if request is None:
                raise ExecutorError("request", "pass the request (to plan it) or a plan",
                                    fix="link.pull(request_id, request)")
            if strategy in RANK_STRATEGIES:  # this rank's part only, on the compiled pair
                plan = self.rank_plan(request, strategy=strategy)
            else:  # auto may pick packed, whose slot protocol needs the whole plan
                plan = self.plan(request, strategy=strategy)
        if plan.prefill_tp != self.pair.prefill.tp or plan.decode_tp != self.pair.decode.tp:
            raise ExecutorError("plan", f"plan for TP{plan.prefill_tp}->TP{plan.decode_tp} on a "
                                f"TP{self.pair.prefill.tp}->TP{self.pair.decode.tp} pair",
                                actual=(plan.prefill_tp, plan.decode_tp),
                                expected=(self.pair.prefill.tp, self.pair.decode.tp))
        if (plan.prefill_ranks, plan.decode_ranks) != (self.pair.prefill.num_ranks, self.pair.decode.num_ranks):
            raise ExecutorError("plan", f"plan for {plan.prefill_ranks} -> {plan.decode_ranks} ranks on a pair of "
                                f"{self.pair.prefill.num_ranks} -> {self.pair.decode.num_ranks} ranks",
                                actual=(plan.prefill_ranks, plan.decode_ranks),
                                expected=(self.pair.prefill.num_ranks, self.pair.decode.num_ranks))
        return plan

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Release the prepared peer tables and forget the peer agents."""
        if self.closed:
            return
        self.closed = True
        for info in self.peers.values():
            self.endpoint.rank_agent.remove_peer(info.agent)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
