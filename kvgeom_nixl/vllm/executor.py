"""The connector's executor: one worker rank's endpoints, links, threads and lock (docs/design.md §15.4).

Every call the connector makes into kvgeom_nixl (:class:`~kvgeom_nixl.Endpoint`,
:class:`~kvgeom_nixl.Link`) is in this module. The engine's thread only queues work and takes
results (:meth:`ConnectorExecutor.pull`, :meth:`release`, :meth:`send`, :meth:`take`); NIXL
progress never waits for an engine step:

    engine thread        start_load_kv -> pull / release / send      get_finished -> take()
                                  |  (queues, one lock)                          ^
    progress thread      every 0.5 ms while a transfer or hold is in flight, 2 ms while other work is
                         pending (50 ms idle), under the lock:
                         decode/prefill .get_finished() -> results; P: hold on D's req, free on release
    jobs thread          D: side-channel handshake (no lock) -> connect, plan, link.pull (lock)
    releases thread      D: releases to P over the side channel (no lock; apart from the jobs so
                         that a P that never answers delays no pull)
    side-channel threads P: a D engine's handshake -> prefill.connect (lock) once all its ranks arrived

Both endpoints share :attr:`ConnectorExecutor.lock` (one ``RLock`` per worker rank, passed as
``Endpoint(..., lock=)``, docs/design.md §8.2), and the executor's own state is guarded by it too,
so every call into an endpoint, a link or a transfer and every read of that state holds one lock
(no lock order to get wrong); network
waits (side channel), probing a peer's NIXL metadata (:func:`probed`) and planning happen outside
it, so the engine's thread never waits for them (a vLLM worker is pinned to one core shared with
other busy threads: starting the prober process alone can take seconds there).

One attempt per request. D pulls with the id P gave its request (``remote_request_id``), so P can
tell which of its pending sends a D rank's ``req`` asks for: the progress thread finds the id
among :meth:`~kvgeom_nixl.Endpoint.pending_notifications`, and holds it (``link.hold``, P knows
only its own blocks) on the link of the D engine that asked, for what is left of its lease. P frees
a request (``finished_sending``) once every D rank released it over the side channel and its hold
is over, or when its lease expires (a live hold is then cancelled: a READ still in flight gets
``cancel``, so D fails that pull and recomputes, docs/design.md §8.1).

kv_both: an :class:`~kvgeom_nixl.Endpoint` has one role, so an instance that both serves and pulls
registers its layer tensors with two endpoints (two NIXL agents), one ``prefill``, one ``decode``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgeom import AttentionSpec, EngineGeometry, GroupKind, KvGeomError, LayerTensors, Pair, request_from_block_tables
from kvgeom_nixl.endpoint import Endpoint, Link
from kvgeom_nixl.errors import ExecutorError, HandshakeError, TransferFailed
from kvgeom_nixl.handshake import HandshakeLimits, RankInfo, decode_rank
from kvgeom_nixl.probe import ProbeRefused, ProberUnavailable, prober
from kvgeom_nixl.transfer import Transfer

from .side_channel import SideChannelError, SideChannelServer, exchange_handshake, send_release

__all__ = ["ConnectorExecutor", "PullJob", "ReleaseJob", "Results", "local_executor", "whole_pages", "STRATEGY",
           "DEFAULT_PULL_TIMEOUT_S", "DEFAULT_HANDSHAKE_TIMEOUT_S"]

STRATEGY = "auto"  # with no staging ring: the cheapest of direct and staged (P serves both by holding its blocks)
DEFAULT_PULL_TIMEOUT_S = 120.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 120.0
FAST_POLL_S = 0.0005  # progress interval while a transfer or a hold is in flight (each protocol step waits a tick)
BUSY_POLL_S = 0.002  # ... while only pulls being posted or pending sends (waiting for D's req) exist
IDLE_POLL_S = 0.05
MAX_COLLECTING = 16  # D engines whose handshakes are being collected at once (hostile bound)
MAX_SEEN = 1 << 16  # P request ids remembered after they were freed (a late duplicate is ignored)

_LOCAL: dict[str, ConnectorExecutor] = {}  # engine id -> the executor of a worker in this process
_LOCAL_LOCK = threading.Lock()


def local_executor(engine_id: str) -> ConnectorExecutor | None:
    """The executor of engine ``engine_id``'s worker when it runs in this process (vLLM's
    single-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or a uni executor in the engine
    core): the scheduler then hands P's pending sends to it at once, because such an engine steps
    only while a caller waits for outputs, and a hold must not wait for the next call."""
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


def probed(payloads: Sequence[bytes], limits: HandshakeLimits) -> list[RankInfo]:
    """The peer ranks' payloads decoded, and each one's NIXL metadata loaded and unloaded in the
    process's prober first (what ``Endpoint.connect`` does with ``probe=True``, done here outside
    the executor's lock so that ``connect(..., probe=False)`` under it is quick). Raises
    :class:`~kvgeom_nixl.errors.HandshakeError` for a payload refused or a blob NIXL refuses."""
    if len(payloads) > limits.max_ranks:
        raise HandshakeError("payloads", f"{len(payloads)} peer payloads, beyond {limits.max_ranks} ranks",
                             actual=len(payloads), expected=f"<= {limits.max_ranks}")
    infos = [decode_rank(p, limits=limits) for p in payloads]
    for info in infos:
        try:
            name = prober().probe(info.metadata)
        except ProbeRefused as e:
            raise HandshakeError(f"payloads[rank {info.rank}].nixl_metadata", f"NIXL refused the metadata: {e}",
                                 fix="send the metadata get_agent_metadata() made, unmodified") from None
        except ProberUnavailable as e:  # the endpoint's own in-process scratch agent probes instead
            raise _NoProber(str(e)) from None
        if name != info.agent:
            raise HandshakeError(f"payloads[rank {info.rank}].agent", f"the NIXL metadata is agent {name[:80]!r}, "
                                 f"the payload says {info.agent[:80]!r}", actual=name, expected=info.agent)
    return infos


class _NoProber(Exception):
    """No prober process could be started: connect probes itself (under the lock)."""


def _connect(ep: Endpoint, lock: Any, payloads: Sequence[bytes]) -> Link:
    """``ep.connect`` for peer ``payloads``: probed outside ``lock``, connected under it."""
    try:
        infos = probed(payloads, ep.limits)
    except _NoProber:
        with lock:
            return ep.connect(payloads)
    with lock:
        return ep.connect(infos, probe=False)


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
    groups = pair.model.groups
    if not groups or any(not isinstance(g, AttentionSpec) or g.kind is not GroupKind.FULL or g.window_tokens
                         for g in groups):
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


@dataclass
class _Send:
    """P: a finished request whose blocks wait for D."""

    expiry: float
    hold: Transfer | None = None
    closing: str = ""  # why it is being freed ("released", "lease expired", "hold ended")


@dataclass
class _Collect:
    """P: the handshakes of one D engine's ranks."""

    tp: int
    started: float
    payloads: dict[int, bytes] = field(default_factory=dict)
    digests: dict[int, bytes] = field(default_factory=dict)
    state: str = "collecting"  # collecting -> connecting -> linked | failed
    error: str = ""


class ConnectorExecutor:
    """One worker rank's executor (see the module docstring); ``close()`` stops its threads."""

    def __init__(self, engine: EngineGeometry, rank: int, tp: int, layers: Sequence[LayerTensors], *, engine_id: str,
                 producer: bool = True, consumer: bool = True, host: str = "127.0.0.1", port: int = 0,
                 staging_bytes: int = 0, pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
                 handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S, strategy: str = STRATEGY,
                 log: logging.Logger | None = None) -> None:
        self.log = log or logging.getLogger(__name__)
        self.engine_id, self.rank, self.tp = engine_id, rank, tp
        self.pull_timeout_s, self.handshake_timeout_s, self.strategy = pull_timeout_s, handshake_timeout_s, strategy
        self.lock = threading.RLock()
        self.prefill = (Endpoint(engine, "prefill", rank, layers, staging_bytes=staging_bytes, lock=self.lock)
                        if producer else None)
        self.decode = (Endpoint(engine, "decode", rank, layers, staging_bytes=staging_bytes, lock=self.lock)
                       if consumer else None)
        self._d_payload = self.decode.handshake() if self.decode is not None else b""
        # D state: links by P engine (jobs thread), posted pulls by transfer id (under the lock)
        self._d_links: dict[str, Link] = {}
        self._pulls: dict[str, PullJob] = {}
        # P state (under the lock): links by D engine, D agent -> engine, pending sends
        self._p_links: dict[str, Link] = {}
        self._agent_engine: dict[str, str] = {}
        self._sends: dict[str, _Send] = {}
        self._seen: dict[str, None] = {}  # every send registered, oldest first (at most MAX_SEEN)
        self._hs: dict[str, _Collect] = {}
        self._hs_cond = threading.Condition()
        self._out = Results()
        self.outcomes: collections.Counter[str] = collections.Counter()  # see counters()
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._releases: queue.Queue[ReleaseJob | None] = queue.Queue()  # their own thread: a hung P delays no pull
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.server: SideChannelServer | None = None
        if self.prefill is not None:
            self.server = SideChannelServer(host, port, self.prefill.handshake(), self._on_handshake)
        self._threads = [threading.Thread(target=self._progress_loop, name=f"kvgeom-progress-{rank}", daemon=True),
                         threading.Thread(target=self._jobs_loop, name=f"kvgeom-jobs-{rank}", daemon=True),
                         threading.Thread(target=self._releases_loop, name=f"kvgeom-releases-{rank}", daemon=True)]
        for t in self._threads:
            t.start()
        with _LOCAL_LOCK:
            _LOCAL[engine_id] = self

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

    def send(self, request_id: str, lease_s: float) -> None:
        """P: keep ``request_id``'s blocks for D for at most ``lease_s`` seconds."""
        with self.lock:
            if request_id in self._seen:  # (already pending, or freed: vLLM frees a request once)
                return
            self._seen[request_id] = None
            while len(self._seen) > MAX_SEEN:
                del self._seen[next(iter(self._seen))]
            self._sends[request_id] = _Send(time.monotonic() + lease_s)
        self._wake.set()

    def take(self) -> Results:
        """Everything that ended since the last call (each id reported once)."""
        with self.lock:
            out, self._out = self._out, Results()
        return out

    def pending(self) -> dict[str, int]:
        """Counts, for tests and logs: posted pulls, pending sends, P and D links, release entries."""
        with self.lock:
            return {"pulls": len(self._pulls), "sends": len(self._sends), "p_links": len(self._p_links),
                    "d_links": len(self._d_links), "releases": self.server.pending() if self.server else 0,
                    "jobs": self._jobs.qsize() + self._releases.qsize()}

    def counters(self) -> dict[str, int]:
        """What this rank holds for requests, and what it did, for leak checks and logs.

        :meth:`pending`'s counts, plus ``holds`` (pending sends a D rank is reading), ``in_flight``
        and ``fencing`` (transfers of both endpoints), ``staging_busy`` / ``staging_waiting``
        (slots owned, chunks queued for one), ``inbox`` (kept ``req`` messages and attempts
        routed by id or nonce), ``unreported`` (results :meth:`take` has not handed out yet): all
        0 on an idle rank. ``inbox_tombs`` and ``inbox_cancelled`` are bounded by time and size
        (not leaks). Then the running totals (never reset): ``freed released``, ``freed lease
        expired``, ``freed hold ended`` (P), ``pull done``, ``pull failed <reason>`` (D)."""
        with self.lock:
            eps = [e for e in (self.prefill, self.decode) if e is not None]
            rings = [e.staging for e in eps if e.staging is not None]
            out = dict(self.pending())
            out.update({
                "holds": sum(s.hold is not None for s in self._sends.values()),
                "in_flight": sum(len(e.in_flight) for e in eps),
                "fencing": sum(len(e.fencing) for e in eps),
                "staging_busy": sum(r.slots - r.free() for r in rings),
                "staging_waiting": sum(len(r.waiting) for r in rings),
                "inbox": sum(len(e.inbox.pending) + len(e.inbox.by_id) + len(e.inbox.by_nonce) for e in eps),
                "unreported": len(self._out.finished_sending) + len(self._out.finished_recving) + len(self._out.failed),
                "inbox_tombs": sum(len(e.inbox.tombs) for e in eps),
                "inbox_cancelled": sum(len(e.inbox.cancelled) for e in eps),
            })
            out.update(self.outcomes)
            return out

    # ---- progress thread -------------------------------------------------------------------
    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            try:
                interval = self._tick()
            except Exception:  # noqa: BLE001 - never let the thread die silently: log, back off, go on
                self.log.exception("kvgeom connector: progress failed")
                interval = IDLE_POLL_S
            self._wake.wait(interval)
            self._wake.clear()

    def _tick(self) -> float:
        """One progress pass; returns how long to wait before the next. A pull is a few protocol
        steps (req, grant, READ, pulled, held), each one tick of one side's thread: while one is in
        flight the thread polls every ``FAST_POLL_S``."""
        with self.lock:
            now = time.monotonic()
            if self.decode is not None:
                self._d_finished(self.decode)
            if self.prefill is not None and self.server is not None:
                self.prefill.get_finished()  # (holds are watched through their transfers below)
                self._p_holds(self.prefill, now)
                self._p_frees(self.server, now)
            if (self.decode is not None and self.decode.in_flight) or (self.prefill is not None
                                                                       and self.prefill.in_flight):
                return FAST_POLL_S
            busy = self._pulls or self._sends or (self.prefill is not None and self.prefill.fencing)
            return BUSY_POLL_S if busy else IDLE_POLL_S

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

    def _p_holds(self, ep: Endpoint, now: float) -> None:
        """Hold every pending send a D rank asked for, on that D engine's link."""
        if not self._sends:
            return
        for (kind, rid), agents in ep.pending_notifications().items():
            s = self._sends.get(rid)
            if kind != "req" or s is None or s.closing or s.hold is not None:
                continue
            engine = next((self._agent_engine[a] for a in sorted(agents) if a in self._agent_engine), None)
            if engine is None:
                continue
            try:
                s.hold = self._p_links[engine].hold(rid, timeout_s=max(s.expiry - now, 0.5))
            except ExecutorError as e:
                self.log.warning("kvgeom connector: cannot hold %s for D engine %s: %s", rid, engine, e)

    def _p_frees(self, server: SideChannelServer, now: float) -> None:
        """Free (report) a pending send once D released it and its hold is over, or its lease passed.

        A release for a request already freed (D released it after the lease expired or after
        D's failed pull ended the hold) is dropped, not kept for the side channel's hour."""
        if server.pending():
            server.forget_if(lambda rid: rid in self._seen and rid not in self._sends)
        for rid, s in list(self._sends.items()):
            if not s.closing:
                if server.released(rid):
                    s.closing = "released"
                elif now > s.expiry:
                    s.closing = "lease expired"
                    self.log.warning("kvgeom connector: the lease of %s expired before D released it", rid)
                elif s.hold is not None and s.hold.settled and s.hold.failure is not None:
                    s.closing = "hold ended"
            if not s.closing:
                continue
            t = s.hold
            if t is not None and not t.settled:
                t.cancel("aborted", f"P frees the request ({s.closing})")
            if t is None or t.fenced:
                self.log.debug("kvgeom connector: %s freed (%s)", rid, s.closing)
                del self._sends[rid]
                self.outcomes[f"freed {s.closing}"] += 1
                server.forget(rid)
                self._out.finished_sending.add(rid)

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
        link = _connect(ep, self.lock, payloads)
        self._d_links[job.engine] = link
        self.log.info("kvgeom connector: D rank %d linked to P engine %s (%d ranks) in %.2f s", self.rank, job.engine,
                      rel.tp, time.monotonic() - started)
        return link

    def _start_pull(self, job: PullJob) -> None:
        started = time.monotonic()
        try:
            link = self._d_link(job)
            M = job.computed_tokens
            tokens = whole_pages(link.pair, M)
            remote = job.remote_blocks
            if tokens == M and job.recomputed_tokens:
                # Not whole pages (a window, or M ends a block): plan the tokens D keeps, M - 1, whose
                # windows end where the recomputed token's begins (design §15.2); P's lists cut to
                # the blocks they use, D's still cover every token vLLM allocated for.
                tokens = M - job.recomputed_tokens
                if tokens <= job.prefix_hit_tokens:  # D holds every token it keeps: nothing to move
                    with self.lock:
                        self._out.finished_recving.add(job.request_id)
                    self._releases.put(job.release)
                    return
                per = link.pair.side("prefill").logical_block_tokens
                remote = tuple(ids[:-(-tokens // per)] for ids in job.remote_blocks)
            request = request_from_block_tables(link.pair, tokens, remote, job.local_blocks,
                                                prefix_hit_tokens=job.prefix_hit_tokens, decode_tokens=max(tokens, M),
                                                null_block=0)
            plan = link.plan(request, strategy=self.strategy)  # outside the lock: the pair is read only
            with self.lock:
                self._pulls[job.transfer_id] = job
                try:
                    link.pull(job.transfer_id, request, plan=plan, timeout_s=self.pull_timeout_s)
                except BaseException:
                    del self._pulls[job.transfer_id]
                    raise
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

    # ---- P: a D engine's handshake (side-channel threads) ----------------------------------
    def _on_handshake(self, engine: str, rank: int, tp: int, payload: bytes) -> None:
        """Collect D engine ``engine``'s payloads; connect once all ``tp`` arrived; return once linked."""
        self.log.debug("kvgeom connector: handshake from D engine %s rank %d of %d", engine, rank, tp)
        digest = hashlib.sha256(payload).digest()
        deadline = time.monotonic() + self.handshake_timeout_s
        connect = False
        with self._hs_cond:
            self._hs_prune()
            c = self._hs.get(engine)
            if c is None or c.tp != tp or c.digests.get(rank, digest) != digest or c.state == "failed":
                if c is None and sum(x.state != "linked" for x in self._hs.values()) >= MAX_COLLECTING:
                    raise SideChannelError("handshake", f"{MAX_COLLECTING} D engines are handshaking already")
                c = self._hs[engine] = _Collect(tp, time.monotonic())
            c.digests[rank] = digest
            if c.state == "linked":
                return
            c.payloads[rank] = payload
            if c.state == "collecting" and len(c.payloads) == tp:
                c.state, connect = "connecting", True
        if connect:
            self._connect_d_engine(engine, c)
        with self._hs_cond:
            while c.state not in ("linked", "failed"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SideChannelError("handshake", f"D engine {engine!r:.80}: {len(c.payloads)} of {tp} ranks "
                                           f"handshook in {self.handshake_timeout_s:.0f} s")
                self._hs_cond.wait(min(left, 1.0))
            if c.state == "failed":
                raise SideChannelError("handshake", f"P rank {self.rank} refused D engine {engine!r:.80}: {c.error}")

    def _connect_d_engine(self, engine: str, c: _Collect) -> None:
        state, error = "linked", ""
        try:
            if self.prefill is None:
                raise ExecutorError("kv_role", "a handshake on an instance without a prefill endpoint")
            with self.lock:
                old = self._p_links.pop(engine, None)
                if old is not None:  # the D engine restarted with new agents
                    for info in old.peers.values():
                        self._agent_engine.pop(info.agent, None)
                    old.close()
            link = _connect(self.prefill, self.lock, [c.payloads[r] for r in range(c.tp)])
            with self.lock:
                self._p_links[engine] = link
                for info in link.peers.values():
                    self._agent_engine[info.agent] = engine
        except Exception as e:  # noqa: BLE001 - refused geometry, bad payload, NIXL: the D engine hears why
            state, error = "failed", f"{type(e).__name__}: {e}"[:400]
            self.log.error("kvgeom connector: handshake of D engine %s refused: %s", engine, error)
        self.log.debug("kvgeom connector: D engine %s %s", engine, state)
        with self._hs_cond:
            c.state, c.error = state, error
            c.payloads.clear()  # the link holds what it needs; only the digests stay (to spot a restart)
            self._hs_cond.notify_all()

    def _hs_prune(self) -> None:
        """Forget collections that never completed (their waiters have given up)."""
        cutoff = time.monotonic() - 2 * self.handshake_timeout_s
        for engine in [e for e, c in self._hs.items() if c.state in ("collecting", "failed") and c.started < cutoff]:
            del self._hs[engine]

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL.get(self.engine_id) is self:
                del _LOCAL[self.engine_id]
        self._stop.set()
        self._wake.set()
        self._jobs.put(None)
        self._releases.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.server is not None:
            self.server.close()
        with self.lock:
            for link in [*self._d_links.values(), *self._p_links.values()]:
                link.close()
            self._d_links.clear()
            self._p_links.clear()
            for ep in (self.decode, self.prefill):
                if ep is not None:
                    ep.close()
