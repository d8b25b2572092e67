"""D's side of the connector's executor: pull jobs (docs/design.md §15.4).

The engine thread queues a :class:`PullJob` per request (:meth:`PullSide.pull`); the jobs thread
handshakes with the P engine once (the link), builds the request from the block tables, plans it
(a packed plan: offers it to P first, :mod:`kvgeom_nixl.vllm.packed_pulls`) and posts the pull under
the executor's lock (``eager``: the READ goes out at once, P's ``held``
after it decides whether the bytes count); the progress thread reports it done or failed
(``_d_finished``). Releases to P go out on their own thread, so a P that never answers delays no
pull. Each request shape's plan and lowering is learnt once (:mod:`kvgeom_nixl.vllm.recipes`):
a later request of the same shape is checked and posted from the recipe, with no planning.

:class:`PullSide` is a part of :class:`~kvgeom_nixl.vllm.executor.ConnectorExecutor` (which owns
the lock, the endpoints and the threads); it holds no state of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvgeom import AttentionSpec, CostModel, GroupKind, KvGeomError, Pair, plan_pair, request_from_block_tables
from kvgeom_nixl.endpoint import Endpoint, Link
from kvgeom_nixl.errors import ExecutorError, TransferFailed

from .packed_pulls import OFFER_TIMEOUT_S, offer_packed
from .recipes import PullRecipes
from .side_channel import SideChannelError, exchange_handshake, send_release

__all__ = ["PullSide", "PullJob", "ReleaseJob", "Results", "whole_pages", "full_attention_only", "STRATEGY",
           "DEFAULT_PULL_TIMEOUT_S", "PACKED_SETUP_S", "connector_costs"]

STRATEGY = "auto"  # the cheapest of direct, staged (P holds its blocks) and packed (P packs D's offer, .packed_pulls)
DEFAULT_PULL_TIMEOUT_S = 120.0
PACKED_SETUP_S = 12e-3  # a packed pull's fixed cost here: the offer, P's planning, the staging round trips


def connector_costs(packed_setup_s: float = PACKED_SETUP_S) -> CostModel:
    """What the connector's ``auto`` weighs: ``CostModel.cpu()`` plus a packed pull's fixed cost
    (``python -m benchmarks.connector_packed``, P block 32 -> D block 64 on the tiny Llama: a packed
    pull took 17 ms against 5.5 ms direct at 100 tokens, both about 20 ms at 1024, 23 against 34 ms
    at 2048; 12 ms puts auto's crossover near 1k tokens too, where the measured one is)."""
    return CostModel(packed_setup_seconds=packed_setup_s)


def full_attention_only(pair: Pair) -> bool:
    """Every group of the model is full attention (no window, no state): a pull may then move
    whole pages, and the token vLLM recomputes too (:func:`whole_pages`)."""
    groups = pair.model.groups
    return bool(groups) and all(isinstance(g, AttentionSpec) and g.kind is GroupKind.FULL and not g.window_tokens
                                for g in groups)


def whole_pages(pair: Pair, computed_tokens: int) -> int:
    """The tokens a pull plans: ``computed_tokens`` rounded up to the end of its last block on both
    sides (the smaller of P's and D's block end, so that each side's listing stays the same length),
    when every group of the model is full attention; else ``computed_tokens`` as it is (a window
    ends at the last token: rounding would move it past tokens D needs).

    The rows past ``computed_tokens`` in that last block are P's rows D overwrites or masks (vLLM
    reads a sequence's KV up to its length, and D computes the prompt's next tokens into those
    slots itself), so moving them changes nothing D reads, and makes the last block a whole page:
    a handful of whole-page copies instead of a copy per K row of every (layer, head) of the
    partly filled block (CPU_ATTN's K plane is dim-major: 264 descriptors for the tiny model's
    partial block, 2 for the whole one)."""
    if not full_attention_only(pair):
        return computed_tokens
    bp, bd = pair.prefill.logical_block_tokens, pair.decode.logical_block_tokens
    return min(-(-computed_tokens // bp) * bp, -(-computed_tokens // bd) * bd)



@dataclass(frozen=True)
class ReleaseJob:
    """Tell every P rank (``port + p``, ``p < tp``) that this D rank is done with P's ``request``."""

    request: str
    host: str
    port: int
    tp: int


@dataclass(frozen=True)
class PullJob:
    """One D request to pull: D's blocks for tokens [prefix_hit_tokens, computed_tokens), P's from 0."""

    request_id: str  # D's request (what vLLM reports back)
    transfer_id: str  # P's request id: the id both sides' attempts carry
    engine: str  # P's engine id
    computed_tokens: int
    prefix_hit_tokens: int
    remote_blocks: tuple[tuple[int, ...], ...]
    local_blocks: tuple[tuple[int, ...], ...]
    release: ReleaseJob
    recomputed_tokens: int = 0  # the last of computed_tokens, which vLLM recomputes on D: not moved


@dataclass
class Results:
    """What the engine takes once per step: finished ids, and D's failed pulls with the blocks
    each may have written (per group; empty when it wrote none of them)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # failed pulls too
    failed: dict[str, dict[int, set[int]]] = field(default_factory=dict)  # D request -> group -> invalid blocks



class PullSide:
    """D: the pull jobs of a :class:`~kvgeom_nixl.vllm.executor.ConnectorExecutor` (see the module docstring)."""

    # (the executor's, set in its __init__)
    log: logging.Logger
    lock: Any
    engine_id: str
    rank: int
    tp: int
    strategy: str
    pull_timeout_s: float
    handshake_timeout_s: float
    decode: Endpoint | None
    outcomes: Counter[str]
    recipes: bool  # learn and use per-shape recipes (False: plan every request, as the first of a shape)
    cost_model: CostModel  # what auto weighs (connector_costs)
    eager: bool  # READ at once, no req/grant (Link.pull's eager): P's held after the READ decides
    _d_payload: bytes
    _d_links: dict[str, Link]
    _d_recipes: dict[str, PullRecipes]
    _pulls: dict[str, PullJob]
    _out: Results
    _jobs: queue.Queue[PullJob | None]
    _releases: queue.Queue[ReleaseJob | None]
    _stop: threading.Event
    _wake: threading.Event

    def _connect_link(self, ep: Endpoint, payloads: list[bytes]) -> Link:
        raise NotImplementedError  # the executor's

    # ---- the engine thread's calls ---------------------------------------------------------
    def pull(self, job: PullJob) -> None:
        """D: pull ``job`` in the background; its outcome comes from :meth:`take`."""
        if self.decode is None:
            self._fail(job, "this instance has no decode endpoint (kv_role is kv_producer)")
            return
        self.log.debug("kvgeom connector: pull of %s (P request %s) queued", job.request_id, job.transfer_id)
        self._jobs.put(job)

    def release(self, job: ReleaseJob) -> None:
        """D: tell P's ranks this D rank needs nothing of ``job.request`` (in the background)."""
        self._releases.put(job)

    def _d_finished(self, ep: Endpoint) -> None:
        f = ep.get_finished()
        for r in f.done:
            job = self._pulls.pop(r.request_id, None)
            if job is not None:
                self._out.finished_recving.add(job.request_id)
                self.outcomes["pull done"] += 1
                self._releases.put(job.release)
                self.log.debug("kvgeom connector: pull of %s done: %d B in %.3f s", job.request_id, r.bytes_moved,
                               r.wall_s)
        for e in f.failed:
            job = self._pulls.pop(e.request_id, None)
            if job is not None:
                self._failed(job, e)


    # ---- jobs thread -----------------------------------------------------------------------
    def _jobs_loop(self) -> None:
        # (the endpoints start the metadata prober in the background; waiting for it here delayed
        # this rank's side-channel handshake, and P waits for every D rank's: on a worker pinned to
        # a busy core the start took over P's handshake timeout)
        while True:
            job = self._jobs.get()
            if job is None or self._stop.is_set():
                return
            try:
                self._start_pull(job)
            except Exception as e:  # noqa: BLE001 - one request fails, never the thread
                self.log.exception("kvgeom connector: job %s failed", job)
                self._fail(job, f"{type(e).__name__}: {e}")

    def _releases_loop(self) -> None:
        """D's releases, one at a time, apart from the pulls: a P that accepts the connection and
        never answers holds this thread up to the side channel's timeout, never a pull."""
        while True:
            job = self._releases.get()
            if job is None or self._stop.is_set():
                return
            try:
                self._release(job)
            except Exception:  # noqa: BLE001 - never the thread
                self.log.exception("kvgeom connector: release %s failed", job)

    def _release(self, job: ReleaseJob) -> None:
        for p in range(job.tp):
            try:
                send_release(job.host, job.port + p, job.request, self.rank, self.tp)
            except SideChannelError as e:  # P gone: its lease frees the blocks
                self.log.warning("kvgeom connector: release of %s to P rank %d failed: %s", job.request, p, e)

    def _d_link(self, job: PullJob) -> Link:
        """The link to P engine ``job.engine``: the side-channel handshake with each of its ranks once."""
        link = self._d_links.get(job.engine)
        if link is not None and not link.closed:
            return link
        rel, started, ep = job.release, time.monotonic(), self.decode
        if ep is None:
            raise ExecutorError("kv_role", "a pull on an instance without a decode endpoint", actual="kv_producer",
                                expected="kv_consumer or kv_both")
        payloads = [exchange_handshake(rel.host, rel.port + p, self.engine_id, self.rank, self.tp, self._d_payload,
                                       timeout_s=self.handshake_timeout_s) for p in range(rel.tp)]
        link = self._connect_link(ep, payloads)
        self._d_links[job.engine] = link
        self.log.info("kvgeom connector: D rank %d linked to P engine %s (%d ranks) in %.2f s", self.rank, job.engine,
                      rel.tp, time.monotonic() - started)
        return link

    def _recipe_book(self, engine: str, link: Link) -> PullRecipes | None:
        """The recipes of ``link`` (new ones when the link to ``engine`` was remade); None when off."""
        if not self.recipes:
            return None
        book = self._d_recipes.get(engine)
        if book is None or book.link is not link:
            book = self._d_recipes[engine] = PullRecipes(link, self.strategy, self.rank, self.cost_model)
        return book

    def _start_pull(self, job: PullJob) -> None:
        started = time.monotonic()
        try:
            link = self._d_link(job)
            M = job.computed_tokens
            tokens = whole_pages(link.pair, M)
            remote = job.remote_blocks
            if tokens == M and job.recomputed_tokens and not full_attention_only(link.pair):
                # Not whole pages (a window): plan the tokens D keeps, M - 1, whose windows end where
                # the recomputed token's begins (design §15.2); P's lists cut to the blocks they use,
                # D's still cover every token vLLM allocated for. (Full attention moves the recomputed
                # token's row too, when M ends a block: D writes the same values over it, and the
                # last block stays a whole page, not a copy per K row plus zeroed rows.)
                tokens = M - job.recomputed_tokens
                if tokens <= job.prefix_hit_tokens:  # D holds every token it keeps: nothing to move
                    with self.lock:
                        self._out.finished_recving.add(job.request_id)
                    self._releases.put(job.release)
                    return
                per = link.pair.side("prefill").logical_block_tokens
                remote = tuple(ids[:-(-tokens // per)] for ids in job.remote_blocks)
            N = max(tokens, M)
            book = self._recipe_book(job.engine, link)
            shape = None if book is None else book.shape(tokens, job.prefix_hit_tokens, N, remote, job.local_blocks)
            got = None if book is None or shape is None else book.apply(shape)
            if got is not None:  # a shape seen before: its rows, no planning (kvgeom_nixl.vllm.recipes)
                with self.lock:
                    self._pulls[job.transfer_id] = job
                    try:
                        link.post_pull(job.transfer_id, got.reads, consumers=got.consumers,
                                       invalid_blocks=got.invalid_blocks, timeout_s=self.pull_timeout_s,
                                       eager=self.eager)
                    except BaseException:
                        del self._pulls[job.transfer_id]
                        raise
            else:
                request = request_from_block_tables(link.pair, tokens, remote, job.local_blocks,
                                                    prefix_hit_tokens=job.prefix_hit_tokens, decode_tokens=N,
                                                    null_block=0)
                # (planned outside the lock, as the design says: only this thread plans on D's pairs)
                plan = plan_pair(link.pair, request, strategy=self.strategy,  # type: ignore[arg-type]
                                 cost_model=self.cost_model, staging_bytes=link.staging_bytes,
                                 budget=link.endpoint.budget)
                if plan.packed:  # P packs for D's plan: it learns the request first (.packed_pulls)
                    offer_packed(link, request, plan, request_id=job.transfer_id, engine=self.engine_id,
                                 rank=self.rank, tp=self.tp, host=job.release.host, port=job.release.port,
                                 timeout_s=min(OFFER_TIMEOUT_S, self.pull_timeout_s))
                with self.lock:
                    self._pulls[job.transfer_id] = job
                    try:
                        t = link.pull(job.transfer_id, request, plan=plan, timeout_s=self.pull_timeout_s,
                                      eager=self.eager)
                    except BaseException:
                        del self._pulls[job.transfer_id]
                        raise
                    posted = t.failure is None
                    if posted and plan.packed:
                        self.outcomes["pulls packed"] += 1
                    consumers = {t.peers[a]: n for a, n in t.consumers.items() if a in t.peers}
                    invalid = dict(t.invalid_blocks)
                if book is not None and shape is not None and posted:
                    book.learn(shape, request, plan, consumers, invalid)  # (after posting: this pull waits for none of it)
        except (KvGeomError, ExecutorError, ValueError) as e:
            self.log.error("kvgeom connector: pull of %s (P request %s) refused: %s", job.request_id,
                           job.transfer_id, e)
            self._fail(job, f"{type(e).__name__}: {e}")
            return
        self._wake.set()
        self.log.debug("kvgeom connector: pull of %s (P request %s) posted in %.3f s", job.request_id,
                       job.transfer_id, time.monotonic() - started)

    # ---- failures --------------------------------------------------------------------------
    def _failed(self, job: PullJob, e: TransferFailed) -> None:
        """A posted pull failed (fenced): its D blocks are invalid, vLLM recomputes them."""
        self.log.error("kvgeom connector: pull of %s (P request %s) failed: %s: %s", job.request_id, job.transfer_id,
                       e.reason, e)
        if e.reason == "peer_disconnected":  # the P engine is gone: the next pull handshakes again
            link = self._d_links.pop(job.engine, None)
            if link is not None:
                link.close()
        bad = {g: set(ids) for g, ids in e.invalid_blocks.items()}
        self.outcomes[f"pull failed {e.reason}"] += 1
        self._report_failure(job, bad)

    def _fail(self, job: PullJob, why: str) -> None:
        """A pull that failed before it was posted: every listed D block is invalid."""
        self.log.error("kvgeom connector: pull of %s failed before posting: %s", job.request_id, why)
        with self.lock:
            self.outcomes["pull failed before posting"] += 1
            self._report_failure(job, {g: set(ids) for g, ids in enumerate(job.local_blocks)})

    def _report_failure(self, job: PullJob, bad: dict[int, set[int]]) -> None:
        with self.lock:
            self._out.finished_recving.add(job.request_id)
            self._out.failed[job.request_id] = {g: ids for g, ids in bad.items() if ids}
        self._releases.put(job.release)
