"""A link: one endpoint's connection to every rank of one peer engine, and the calls of one request.

    Link (made by Endpoint.connect; holds the Pair, built once, and the peer ranks' handshakes)
      .plan(request) / .rank_plan(request)       the whole plan, or this rank's part (compiled pair)
      D rank:  .pull(id, request)         req -> grant -> READ -> held        (docs/design.md §8.1)
               .post_pull(id, reads)      the same with this rank's rows planned already (no planning)
               .accept_push(id, request)  req -> P's WRITE + pushed -> receive steps -> acked
      P rank:  .serve_pull(id, request)   grant each D rank that asks, held after its READ, done on acked
               .hold(id)                  the same knowing only this rank's blocks (no plan)
               .push(id, request)         WRITE once D's req arrived, done on acked
      .close()                            forget the peer agents (their transfers fail, fences lift)

Each call checks its role, id, timeout and input, plans (or takes the plan) under the budget,
makes a :class:`~kvgeom_nixl.transfer.Transfer` (or a packed one, :mod:`kvgeom_nixl.packed`),
lowers this rank's copies to posters (:mod:`kvgeom_nixl.posting`) and hands the transfer to the
endpoint, which drives it (:meth:`Endpoint.progress <kvgeom_nixl.endpoint.Endpoint.progress>`).
Every call holds the endpoint's lock (docs/design.md §8.2).

Hostile peers (docs/design.md §14): every planning call (``plan``, ``pull``, ``push``,
``serve_pull``, ``accept_push``) takes a ``strategy`` and a ``budget`` (:class:`kvgeom.PlanBudget`,
the endpoint's by default) and refuses a request whose plan would exceed it
(:class:`kvgeom.PlanBudgetExceeded`) before building it; ``timeout_s`` must be finite and
positive, and the deadline starts before planning, so it covers the planning too.

Worked number: P TP2 -> D TP1 on 4 fresh blocks, HND, pull: D rank 0 posts 2 NIXL requests (one
per P rank); each P rank counts 1 consumer (``plan.consumers() == [1, 1]``). With pipeline stages
(docs/design.md §11) a D rank of P PP2 x TP1 -> D TP2 posts 2 requests, one per P stage.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvgeom import (
    CompiledPair,
    Copies,
    CostModel,
    EngineGeometry,
    Pair,
    PlanBudget,
    PlanBudgetExceeded,
    PlanError,
    Rearrange,
    Request,
    RequestShape,
    TransferPlan,
    Zeros,
    check_budget,
    plan_pair,
    plan_reference,
    tile_bytes,
    value_text,
)
from kvgeom.values import CopyBlock, check_instance, check_int, check_seconds

from .agent import RankAgent
from .errors import ExecutorError
from .handshake import RankInfo
from .lowering import MODES, copy_descs
from .memory import RankMemory
from .packed import PackedTransfer
from .posting import posters, sides
from .protocol import MAX_ID
from .staging import StagingBuffer
from .threads import locked
from .transfer import Messenger, Transfer

__all__ = ["Link", "Owner", "DEFAULT_TIMEOUT_S", "check_timeout", "RANK_STRATEGIES"]

DEFAULT_TIMEOUT_S = 30.0
RANK_STRATEGIES = ("direct", "staged")  # planned per rank on the compiled pair when a link plans itself


def check_timeout(path: str, timeout_s: Any) -> float:
    """A timeout in seconds: finite and > 0 (``nan`` would disable the deadline), else :class:`ExecutorError`."""
    return check_seconds(path, timeout_s, error=ExecutorError)


class Owner(Messenger, Protocol):
    """What a link needs of its endpoint (:class:`kvgeom_nixl.Endpoint`): its rank, agent, memory and
    staging ring, the lock, and the calls that register and drive a transfer."""

    name: str
    role: str
    rank: int
    engine: EngineGeometry
    budget: PlanBudget
    memory: RankMemory
    rank_agent: RankAgent
    staging: StagingBuffer | None
    staging_grace_s: float
    closed: bool

    def track(self, transfer: Transfer) -> Transfer: ...

    def check_id(self, request_id: str, what: str) -> None: ...

    def peer_removed(self, agent: str) -> None: ...

    def receive(self, rearranges: Sequence[Rearrange], zeros: Zeros) -> Any: ...

    def run_staged(self, steps: Sequence[Any], slot: int, pack: bool) -> Any: ...

    def sign_document(self, agent: str, request_id: str, document_sha256: bytes) -> str: ...

    def document_signed(self, agent: str, request_id: str, document_sha256: bytes, mac: str) -> bool: ...


class Link:
    """The local endpoint's connection to every rank of one peer engine; holds the :class:`Pair`."""

    def __init__(self, endpoint: Owner, peers: dict[int, RankInfo], pair: Pair) -> None:
        self.endpoint = endpoint
        self.peers = peers
        self.pair = pair
        self.peer_engine = next(iter(peers.values())).engine
        self._tile: int | None = None
        self._columns: dict[int | None, _Regions] = {}
        self.closed = False

    @property
    def lock(self) -> Any:
        """The endpoint's lock (every call of the link holds it)."""
        return self.endpoint.lock

    @property
    def local_is_decode(self) -> bool:
        return self.endpoint.role == "decode"

    # ---- planning --------------------------------------------------------------------------
    @locked
    def plan(self, request: Request, *, strategy: str = "direct", budget: PlanBudget | None = None,
             cost_model: CostModel | None = None) -> TransferPlan:
        """The plan for ``request`` on this pair (:func:`kvgeom.planning.plan_pair`) under ``budget``
        (default: the endpoint's); raises :class:`kvgeom.PlanBudgetExceeded` before building a plan
        beyond it. Packed and auto plans use :attr:`staging_bytes` as the chunk capacity, so without
        staging on both sides auto never picks packed and packed raises
        :class:`~kvgeom.errors.StagingCapacityError`. ``cost_model``: what auto weighs (default
        ``CostModel.cpu()``)."""
        return plan_pair(self.pair, request, strategy=strategy,  # type: ignore[arg-type]
                         cost_model=CostModel() if cost_model is None else cost_model,
                         staging_bytes=self.staging_bytes, budget=self.endpoint.budget if budget is None else budget)

    @property
    def staging_bytes(self) -> int:
        """The slot size both sides have (0 when either has no staging buffer): what a packed plan's
        busiest chunk may stage on one rank."""
        own = self.endpoint.staging
        sizes = [info.staging[3] if info.staging is not None else 0 for info in self.peers.values()]
        return min([own.slot_bytes if own is not None else 0] + sizes)

    @locked
    def rank_plan(self, request: Request, *, strategy: str = "direct", budget: PlanBudget | None = None) -> TransferPlan:
        """What this rank posts and applies for ``request``, planned on the compiled pair for this
        rank only (``plan.for_decode_rank(rank)`` on D, ``plan.for_prefill_rank(rank)``'s copies on
        P; docs/design.md §13.4). The pair compiles on the link's first request, when compiling fits
        ``budget`` (the endpoint's by default; else the reference path plans, the same rows); a
        request whose plan would exceed it raises :class:`kvgeom.PlanBudgetExceeded`."""
        plan, _ = self._planned(request, None, strategy, budget, "coalesced")
        return plan

    def _planned(self, request: Request | None, plan: TransferPlan | None, strategy: str, budget: PlanBudget | None,
                 mode: str) -> tuple[TransferPlan, tuple[CopyBlock, ...] | None]:
        """The plan a transfer call runs, and (mode prepped, this rank planned on the compiled pair)
        its copies as outer-sum blocks for the tile indices (no byte columns)."""
        if plan is not None or request is None or strategy not in RANK_STRATEGIES:
            return self._plan(request, plan, strategy, budget), None
        check_instance("request", request, Request, error=ExecutorError, fix="pass a kvgeom.Request")
        budget = self.endpoint.budget if budget is None else budget
        check_budget(self.pair, RequestShape.of(request), strategy, staging_bytes=self.staging_bytes, budget=budget)
        try:
            compiled: CompiledPair | None = self.pair.compile(budget=budget)
        except PlanBudgetExceeded:  # a pair too costly to compile plans on the reference path
            compiled = None
        rank, kw = self.endpoint.rank, {"decode_rank" if self.local_is_decode else "prefill_rank": self.endpoint.rank}
        blocks = None
        if compiled is None:
            whole = plan_reference(self.pair, request, strategy=strategy, budget=None)  # type: ignore[arg-type]
            plan = whole.for_decode_rank(rank) if self.local_is_decode else whole.packed_for_prefill_rank(rank)
        else:
            if mode == "prepped":
                blocks = compiled.copy_blocks(request, strategy=strategy, budget=None, **kw)  # type: ignore[arg-type]
            plan = compiled.plan(request, strategy=strategy, budget=None, **kw)  # type: ignore[arg-type]
        return self._plan(request, plan, strategy, budget), blocks

    @property
    def tile_bytes(self) -> int:
        if self._tile is None:
            self._tile = tile_bytes(self.pair)
        return self._tile

    # ---- initiators ----------------------------------------------------------------------
    @locked
    def pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
             budget: PlanBudget | None = None, eager: bool = False) -> Transfer:
        """D rank: ask every P rank it needs (``req``), READ this rank's rows from each once it grants,
        done when each has confirmed it still held its blocks (``held``); returns at once (a packed
        plan is pulled chunk by chunk through the staging rings, docs/design.md §12.5).

        Without ``plan`` the request is planned with ``strategy`` under ``budget`` (the endpoint's by
        default); ``timeout_s`` counts from this call, planning included. ``eager`` (direct plans):
        READ at once, with no ``req`` and no wait for the grant; P's ``held`` after the READ still
        decides whether the bytes count (one round trip and one message less; a READ of blocks P no
        longer holds fails instead of never being posted; :mod:`kvgeom_nixl.transfer`)."""
        started = time.perf_counter()
        timeout_s = self._begin("decode", "pull", request_id, timeout_s, request, plan)
        plan, blocks = self._planned(request, plan, strategy, budget, mode)
        if plan.packed:
            return self._packed("pull", request_id, request, plan, mode, timeout_s, started)
        t = self._transfer("pull", request_id, request, plan, self._mode(mode), timeout_s, started, eager=eager)
        if not self._expired(t, timeout_s):
            copies = t.decode_part().copies
            t.posters = posters(self, t, copies, "READ", blocks)
            if not t.settled:
                t.peers = {self.peers[p].agent: p for p in sorted(self._peer_ranks(copies))}
                t.consumers = self._consumers(request, plan, strategy, budget, set(t.peers.values()))
        return self.endpoint.track(t)

    @locked
    def push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
             budget: PlanBudget | None = None) -> Transfer:
        """P rank: WRITE this rank's rows to every D rank that needs them once that D rank's
        ``accept_push`` has asked (``req``), done when each has acknowledged (``acked``); returns at
        once (packed: each chunk once its D slots are granted; ``strategy``, ``budget`` and
        ``timeout_s`` as in :meth:`pull`)."""
        started = time.perf_counter()
        timeout_s = self._begin("prefill", "push", request_id, timeout_s, request, plan)
        plan, blocks = self._planned(request, plan, strategy, budget, mode)
        if plan.packed:
            return self._packed("push", request_id, request, plan, mode, timeout_s, started)
        t = self._transfer("push", request_id, request, plan, self._mode(mode), timeout_s, started)
        if not self._expired(t, timeout_s):
            copies = plan.for_prefill_rank(self.endpoint.rank)
            t.posters = posters(self, t, copies, "WRITE", blocks)
            if not t.settled:
                t.peers = {self.peers[d].agent: d for d in sorted(self._peer_ranks(copies))}
        return self.endpoint.track(t)

    @locked
    def post_pull(self, request_id: str, reads: Mapping[int, Sequence[np.ndarray]], *, consumers: Mapping[int, int],
                  invalid_blocks: Mapping[int, tuple[int, ...]], timeout_s: float = DEFAULT_TIMEOUT_S,
                  eager: bool = False) -> Transfer:
        """D rank: :meth:`pull` with this rank's rows already planned (a caller that keeps a plan's
        rows per request shape: :mod:`kvgeom_nixl.vllm.recipes`); nothing is planned here.

        ``reads[p] = (d_region, d_offset, p_region, p_offset, nbytes)``: the int64 columns of the
        plan's copies this D rank reads from P rank ``p``, in posting order; ``consumers[p]`` the D
        ranks reading from P rank ``p`` (told in ``req``, as :meth:`pull` does);
        ``invalid_blocks`` the D blocks (per group) a failure invalidates. Every row is checked
        inside both ranks' regions before anything is posted, as :meth:`pull`'s lowering does
        (:class:`kvgeom.PlanError` fails the transfer); a P rank this link was not given raises
        :class:`ExecutorError`. Posted coalesced (one descriptor per row); ``eager`` as in :meth:`pull`."""
        started = time.perf_counter()
        timeout_s = self._begin("decode", "pull", request_id, timeout_s, None, reads)
        ep = self.endpoint
        t = Transfer(ep, ep.rank_agent, "pull", request_id, None, None, "coalesced", timeout_s, role=ep.role,
                     rank=ep.rank, started=started, invalid_blocks=invalid_blocks, resend_s=ep.staging_grace_s,
                     eager=eager)
        agent = ep.rank_agent
        sides = {}
        try:
            own = self._memory_columns(None)
            for p in sorted(reads):
                peer = self._memory_columns(int(p))
                cols = reads[p]
                if len(cols) != 5 or len({len(c) for c in cols}) != 1:
                    raise PlanError(f"reads[{p}]", "five equal-length columns (d_region, d_offset, p_region, "
                                    "p_offset, nbytes)", actual=[len(c) for c in cols])
                d_region, d_offset, p_region, p_offset, nbytes = cols
                sides[int(p)] = (_lowered("d", d_region, d_offset, nbytes, own),
                                 _lowered("p", p_region, p_offset, nbytes, peer))
        except PlanError as e:
            t.fail("plan_error", f"posting: {type(e).__name__}: {e}")
            return ep.track(t)
        for p, (local, remote) in sides.items():
            info = self.peers[p]
            nbytes = reads[p][4]

            def coalesced(notif: bytes, local: np.ndarray = local, remote: np.ndarray = remote, info: RankInfo = info,
                          n: int = len(nbytes), total: int = int(nbytes.sum())) -> tuple[Any, int, int]:
                return agent.post_coalesced("READ", local, remote, info.mem_type, info.agent, notif), n, total

            t.posters[info.agent] = coalesced
            t.peers[info.agent] = p
            t.consumers[info.agent] = int(consumers.get(p, 0))
        if self._expired(t, timeout_s):
            t.posters.clear()
        return ep.track(t)

    def _memory_columns(self, peer: int | None) -> _Regions:
        """(bases, devices, sizes) per region of this rank (``peer`` None) or of peer rank ``peer``
        (:meth:`peer_info`'s check), built once per link."""
        cols = self._columns.get(peer)
        if cols is None:
            src: Any = self.endpoint.memory if peer is None else self.peer_info(peer)
            sizes = np.asarray(src.sizes, dtype=np.int64)
            cols = self._columns[peer] = _Regions(src.bases, src.devices, sizes, src.bases.tolist(),
                                                  src.devices.tolist(), sizes.tolist())
        return cols

    # ---- passive sides ---------------------------------------------------------------------
    @locked
    def accept_push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
                    budget: PlanBudget | None = None) -> Transfer:
        """D rank: ask every P rank this rank reads from to push (``req``), wait for each WRITE's
        notification, run the receive steps and acknowledge (packed: grant slots as P asks, unpack
        each chunk as it lands; ``strategy``, ``budget`` and ``timeout_s`` as in :meth:`pull`)."""
        started = time.perf_counter()
        timeout_s = self._begin("decode", "accept_push", request_id, timeout_s, request, plan)
        plan = self._plan(request, plan, strategy, budget, "link.accept_push(request_id, request)")
        if plan.packed:
            return self._packed("accept_push", request_id, request, plan, "coalesced", timeout_s, started)
        rank = self.endpoint.rank
        t = self._transfer("accept_push", request_id, request, plan, "-", timeout_s, started)
        t.bytes_moved = t.decode_part().bytes_copied
        t.peers = {self.peer_info(p).agent: p for p in plan.sources_of(rank)}
        return self.endpoint.track(t)

    @locked
    def serve_pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
                   budget: PlanBudget | None = None) -> Transfer:
        """P rank: hold this rank's blocks for ``request_id``, grant each D rank that reads from it
        (``plan.consumers()``), done when each has confirmed its READ (packed: pack each chunk once
        its D slots are granted). :meth:`hold` is the same without a request.

        The plan is built from the peer's self-description under ``budget`` (the endpoint's by
        default), and ``timeout_s`` counts from this call, so a hostile geometry can neither make
        the planning unbounded nor hide it from the deadline."""
        started = time.perf_counter()
        timeout_s = self._begin("prefill", "serve_pull", request_id, timeout_s, request, plan)
        plan = self._plan(request, plan, strategy, budget, "link.serve_pull(request_id, request), or "
                          "link.hold(request_id) for a direct pull without the request")
        if plan.packed:
            return self._packed("serve_pull", request_id, request, plan, "coalesced", timeout_s, started)
        p = self.endpoint.rank
        mine = plan.for_prefill_rank(p)
        consumers = {int(d) for d in np.unique(mine.d_rank)}
        if len(consumers) != int(plan.consumers()[p]):
            raise ExecutorError("plan.consumers", "the consumer count disagrees with the plan's rows",
                                actual=int(plan.consumers()[p]), expected=len(consumers))
        t = self._transfer("serve_pull", request_id, request, plan, "-", timeout_s, started,
                           bytes_moved=mine.total_bytes)
        t.peers = {self.peer_info(d).agent: d for d in sorted(consumers)}
        t.expect_count = len(consumers)
        return self.endpoint.track(t)

    @locked
    def hold(self, request_id: str, *, consumers: int | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        """P rank, direct pulls, knowing only its own blocks: hold them for ``request_id`` until
        ``consumers`` D ranks (default: as many as the D ranks' ``req`` say) have READ them and
        confirmed, or until ``timeout_s``. No plan: D plans and READs; P grants every D rank of the
        link that asks for the id, and answers each READ's notification with ``held`` while it
        still holds (a READ that finishes after the hold ended gets ``cancel``: D fails it). The
        caller keeps the blocks untouched until the transfer settles."""
        started = time.perf_counter()
        timeout_s = self._begin("prefill", "hold", request_id, timeout_s, None, None)
        if consumers is not None:
            consumers = check_int("consumers", consumers, minimum=1, error=ExecutorError)
            if consumers > len(self.peers):
                raise ExecutorError("consumers", f"{consumers} D ranks on a link to {len(self.peers)}",
                                    actual=consumers, expected=f"<= {len(self.peers)}",
                                    fix="pass how many D ranks read this rank's blocks")
        ep = self.endpoint
        t = Transfer(ep, ep.rank_agent, "hold", request_id, None, None, "-", timeout_s, role=ep.role, rank=ep.rank,
                     peers={info.agent: r for r, info in self.peers.items()}, expect_count=consumers,
                     started=started, resend_s=ep.staging_grace_s)
        return ep.track(t)

    # ---- documents beside NIXL --------------------------------------------------------------
    @locked
    def sign_document(self, peer: int, request_id: str, document_sha256: bytes) -> tuple[str, str]:
        """``(this rank's agent, MAC)`` for a document about ``request_id`` (given its SHA-256), for
        peer rank ``peer`` to check with :meth:`document_signer`: a caller's own channel (the vLLM
        connector's side channel) then carries it with the same authentication as the link's
        notifications (docs/design.md §8.1). The caller hashes the document, outside the lock."""
        return self.endpoint.name, self.endpoint.sign_document(self.peer_info(peer).agent, request_id, document_sha256)

    @locked
    def document_signer(self, agent: str, request_id: str, document_sha256: bytes, mac: str) -> int | None:
        """The peer rank whose agent ``agent`` signed a document about ``request_id`` (given its
        SHA-256, hashed by the caller before taking any lock) for this rank (:meth:`sign_document`),
        or None: not a peer of this link, a closed link, or a MAC that does not check."""
        rank = next((r for r, info in self.peers.items() if info.agent == agent), None)
        if rank is None or self.closed or not self.endpoint.document_signed(agent, request_id, document_sha256, mac):
            return None
        return rank

    # ---- one request -----------------------------------------------------------------------
    def _begin(self, role: str, what: str, request_id: Any, timeout_s: Any, request: Any, plan: Any) -> float:
        """The checks every transfer call makes before any work: role, open link, id (not in flight
        on the endpoint), timeout, and (but for hold) a request or a plan."""
        self._require(role, what)
        if not isinstance(request_id, str) or not request_id or "|" in request_id or len(request_id) > MAX_ID:
            raise ExecutorError("request_id", f"{what} needs a non-empty string id without '|' (at most {MAX_ID} "
                                f"characters), got {type(request_id).__name__}", actual=value_text(request_id, 80),
                                expected="a string", fix="use the scheduler's request id as a string")
        timeout_s = check_timeout("timeout_s", timeout_s)
        if what != "hold" and request is None and plan is None:
            fix = {"pull": "link.pull(request_id, request)", "push": "link.push(request_id, request)",
                   "accept_push": "link.accept_push(request_id, request)",
                   "serve_pull": "link.serve_pull(request_id, request), or link.hold(request_id) to serve a "
                                 "direct pull knowing only this rank's blocks"}[what]
            raise ExecutorError("request", f"{what} needs the request (to plan it) or a plan", fix=fix)
        self.endpoint.check_id(request_id, what)
        return timeout_s

    @staticmethod
    def _expired(t: Transfer, timeout_s: float) -> bool:
        """Fail ``t`` (nothing posted) when planning used up its timeout."""
        if t.expired():
            t.fail("timeout", f"planning took longer than the {timeout_s:.3g} s timeout; nothing was posted")
            return True
        return False

    def _packed(self, kind: str, request_id: str, request: Request | None, plan: TransferPlan, mode: str,
                timeout_s: float, started: float) -> Transfer:
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
        peers = {int(p): self.peer_info(int(p)) for p in np.unique(peer_col[own_col == ep.rank])}
        invalid = self.pair.writable_blocks(request) if request is not None and self.local_is_decode else {}
        t: Transfer
        t = PackedTransfer(ep, ep.rank_agent, kind, request_id, request, plan, timeout_s, role=ep.role, rank=ep.rank,
                           buffer=ep.staging, peers=peers, run_steps=ep.run_staged,
                           receive=ep.receive if self.local_is_decode else None, grace_s=ep.staging_grace_s,
                           started=started, invalid_blocks=invalid)
        if mode == "prepped":
            t.fall_back("coalesced", "packed plans post their wire rows as coalesced lists")
        if self._expired(t, timeout_s):
            return ep.track(t)
        try:
            t.check_fit()
        except PlanError as e:
            t.fail("plan_error", f"{type(e).__name__}: {e}")
        return ep.track(t)

    def _transfer(self, kind: str, request_id: str, request: Request | None, plan: TransferPlan, mode: str,
                  timeout_s: float, started: float, *, bytes_moved: int = 0, eager: bool = False) -> Transfer:
        ep = self.endpoint
        invalid = self.pair.writable_blocks(request) if request is not None and self.local_is_decode else {}
        return Transfer(ep, ep.rank_agent, kind, request_id, request, plan, mode, timeout_s, role=ep.role,
                        rank=ep.rank, bytes_moved=bytes_moved, receive=ep.receive if self.local_is_decode else None,
                        started=started, invalid_blocks=invalid, resend_s=ep.staging_grace_s, eager=eager)

    def _peer_ranks(self, copies: Copies) -> set[int]:
        return {int(r) for r in np.unique(sides(copies, self.local_is_decode)[0])}

    def _consumers(self, request: Request | None, plan: TransferPlan, strategy: str, budget: PlanBudget | None,
                   sources: set[int]) -> dict[str, int]:
        """D: per P agent, how many D ranks read from it (told in ``req``, so a P rank that holds
        without a plan knows when it is done): from the whole plan, or (a plan of this rank only)
        from each source's own rank plan on the compiled pair."""
        rank_plan = plan.decode_ranks > 1 and not len(plan.copies.take(plan.copies.d_rank != self.endpoint.rank)) \
            and request is not None and strategy in RANK_STRATEGIES
        counts = plan.consumers()
        out: dict[str, int] = {}
        for p in sources:
            n = int(counts[p])
            if rank_plan and request is not None:
                try:
                    compiled = self.pair.compile(budget=self.endpoint.budget if budget is None else budget)
                    theirs = compiled.plan(request, strategy=strategy, budget=None,  # type: ignore[arg-type]
                                           prefill_rank=p)
                    n = len({int(d) for d in np.unique(theirs.copies.d_rank)})
                except PlanBudgetExceeded:
                    n = 0  # unknown: a P rank that holds without a plan waits for its timeout
            out[self.peers[p].agent] = n
        return out

    # ---- checks ----------------------------------------------------------------------------
    def peer_info(self, rank: int) -> RankInfo:
        """The handshake of peer rank ``rank``; :class:`ExecutorError` when this link was not given it."""
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
            raise ExecutorError("mode", f"unknown lowering mode {value_text(mode, 60)}", actual=mode, expected=list(MODES))
        return mode

    def _plan(self, request: Request | None, plan: TransferPlan | None, strategy: str = "direct",
              budget: PlanBudget | None = None, fix: str = "link.pull(request_id, request)") -> TransferPlan:
        if request is not None:
            check_instance("request", request, Request, error=ExecutorError, fix="pass a kvgeom.Request")
        if plan is None:
            if request is None:
                raise ExecutorError("request", "pass the request (to plan it) or a plan", fix=fix)
            if strategy in RANK_STRATEGIES:  # this rank's part only, on the compiled pair
                return self.rank_plan(request, strategy=strategy, budget=budget)
            plan = self.plan(request, strategy=strategy, budget=budget)  # auto may pick packed: the whole plan
        check_instance("plan", plan, TransferPlan, error=ExecutorError, fix="pass the plan kvgeom made")
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
    @locked
    def close(self) -> None:
        """Release the prepared peer tables and forget the peer agents."""
        if self.closed:
            return
        self.closed = True
        for info in self.peers.values():
            self.endpoint.rank_agent.remove_peer(info.agent)
            self.endpoint.peer_removed(info.agent)  # "agent removed": its transfers fail, their fences lift

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Regions(NamedTuple):
    """One rank's regions as :meth:`Link.post_pull` reads them: numpy columns, and the same as lists."""

    bases: np.ndarray  # uint64 addresses
    devices: np.ndarray
    sizes: np.ndarray  # int64 bytes
    bases_list: list[int]
    devices_list: list[int]
    sizes_list: list[int]


_FEW_ROWS = 32  # up to this many rows, one Python pass checks and lowers them (quicker than numpy's calls)


def _lowered(side: str, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, regions: _Regions) -> np.ndarray:
    """The rows' ``(addr, len, dev)`` descriptors (Nx3 uint64, :func:`copy_descs`), after
    :func:`_check_rows`'s check; :class:`PlanError` names the first row outside ``regions``."""
    if len(region) <= _FEW_ROWS and all(type(c) is np.ndarray and c.dtype == np.int64 and c.ndim == 1
                                        for c in (region, offset, nbytes)):
        bases, devices, sizes = regions.bases_list, regions.devices_list, regions.sizes_list
        n, out = len(sizes), []
        for r, o, b in zip(region.tolist(), offset.tolist(), nbytes.tolist()):
            if not (0 <= r < n and o >= 0 and b > 0 and o + b <= sizes[r]):
                break  # (the check below names it)
            out.append((bases[r] + o, b, devices[r]))
        else:
            return np.array(out, dtype=np.uint64).reshape(-1, 3)
    _check_rows(side, region, offset, nbytes, regions.sizes)
    return copy_descs(regions.bases, regions.devices, region, offset, nbytes)


def _check_rows(side: str, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, sizes: np.ndarray) -> None:
    """:class:`PlanError` unless every row (int64 columns) is a positive run inside its region of
    ``sizes`` (:meth:`Link.post_pull`'s check, the one lowering makes of a plan's copies; a few
    rows are checked by :func:`_lowered`'s own pass, which calls this to name a row it refuses)."""
    for name, col in ((f"{side}_region", region), (f"{side}_offset", offset), ("nbytes", nbytes)):
        if not isinstance(col, np.ndarray) or col.dtype != np.int64 or col.ndim != 1:
            raise PlanError(f"reads.{name}", "a one-dimensional int64 column", actual=value_text(col, 60),
                            expected="numpy int64 array")
    if not len(region):
        return
    n = len(sizes)
    if int(region.min()) >= 0 and int(region.max()) < n and int(offset.min()) >= 0 and int(nbytes.min()) > 0 \
            and not (offset > sizes[region] - nbytes).any():  # (not offset + nbytes: it can wrap past 2**63)
        return
    bad = (region < 0) | (region >= n) | (offset < 0) | (nbytes <= 0)
    bad[~bad] = (offset > sizes[np.clip(region, 0, max(n - 1, 0))] - nbytes)[~bad] if n else True
    i = int(np.flatnonzero(bad)[0])
    raise PlanError(f"reads.{side}_offset[{i}]", f"bytes [{int(offset[i])}, {int(offset[i]) + int(nbytes[i])}) of "
                    f"region {int(region[i])} are not inside the rank's {n} regions",
                    actual=(int(region[i]), int(offset[i]), int(nbytes[i])),
                    expected=f"regions of {[int(x) for x in sizes]} B",
                    fix="post rows of a plan for this pair (docs/design.md §15.4)")
