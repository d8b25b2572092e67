"""Timing hooks on D's connector worker, for ``python -m benchmarks.vllm_connector``.

Installed by ``tests/vllm_e2e_site/sitecustomize.py`` in a vLLM instance's processes when
``KVGEOM_BENCH_TIMINGS`` names a file: each hook wraps one method of a connector's worker side
(library code is not changed) and appends one JSON line per event to that file:

* ``post``: the per-request work of posting D's pull, timed on the worker: ``t0``/``t1`` around
  it, ``cpu`` its thread's CPU time in it, ``blocks`` the D blocks it writes, ``posted`` whether
  a transfer was left in flight. kvgeom: ``ConnectorExecutor._start_pull``
  (build the request from the block tables, plan it, post the pull under the lock; on the jobs
  thread). vLLM's NixlConnector: ``NixlPullConnectorWorker._read_blocks_for_req`` (map the block
  ids, build the descriptor ids, ``make_prepped_xfer`` + ``transfer``; on the engine's thread).
* ``post_part``: kvgeom only, the READ itself when it is posted later by the progress thread once
  P granted (``Transfer._post_to``: the NIXL descriptor lists, ``initialize_xfer`` + ``transfer``),
  keyed by P's request id (``tid``, also in kvgeom's ``post`` event); it counts in the overhead.
  An eager pull's READ (``"eager_pull": true``) is posted by the
  progress thread right after ``_start_pull`` queued it, often before ``_start_pull`` returns: it
  counts as posted at its ``post_part``'s end, which may come before the post event's.
* ``queued``: kvgeom only, when the engine thread hands the pull to the executor
  (``ConnectorExecutor.pull``; vLLM's connector posts in the same call, so its ``t0`` is that).
* ``done``: when the worker first sees the transfer finished (kvgeom: its progress thread's
  ``_d_finished``; vLLM: ``_pop_done_transfers`` of its receiving transfers, once per step).
* ``engine``: the worker's ``start_load_kv`` on vLLM's engine thread, for a call that started
  pulls (``reqs``: their D request ids), with ``cpu`` its thread CPU time less the hooks' own
  writes inside it. kvgeom: ``KvgeomWorker.start_load_kv`` (the pull jobs built from the metadata
  and queued; plan and post run on the connector's own threads); vLLM: ``NixlPullConnectorWorker
  .start_load_kv`` (kernel block ids, then ``_read_blocks_for_req``: the whole post). What the
  engine thread spends on a request's pull, where it delays the forward pass most directly.

With ``KVGEOM_BENCH_BEFORE`` also set, :func:`_before` undoes the connector fixes the benchmark
measured, in that process only.

Every time is ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for every process).
:func:`request_timings` turns one request's events into the benchmark's numbers.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV", "BEFORE", "install_kvgeom", "install_kvgeom_engine", "install_nixl", "RequestTiming",
           "request_timings", "read_events"]

ENV = "KVGEOM_BENCH_TIMINGS"
BEFORE = "KVGEOM_BENCH_BEFORE"  # set (with ENV): the kvgeom connector as it was before the fixes, see _before
_WRITE = threading.Lock()
_ENGINE = threading.local()  # inside a timed start_load_kv: .reqs (pulls started), .hooks_cpu (our writes)


def _emit(path: str, **event: Any) -> None:
    inside = getattr(_ENGINE, "reqs", None) is not None  # in a timed start_load_kv: not its own cost
    c0 = time.thread_time() if inside else 0.0
    line = json.dumps(event) + "\n"
    with _WRITE, open(path, "a") as f:
        f.write(line)
    if inside:
        _ENGINE.hooks_cpu += time.thread_time() - c0


def _started(req: str) -> None:
    """A pull of ``req`` started inside the timed ``start_load_kv`` running on this thread (if any)."""
    reqs = getattr(_ENGINE, "reqs", None)
    if reqs is not None:
        reqs.append(req)


def _engine(connector: str, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``engine`` event's wrapper of a worker's ``start_load_kv`` (module docstring)."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            _ENGINE.reqs, _ENGINE.hooks_cpu = [], 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(self, *args, **kwargs)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                reqs, hooks = _ENGINE.reqs, _ENGINE.hooks_cpu
                _ENGINE.reqs = None
                if reqs:
                    _emit(path, kind="engine", connector=connector, reqs=reqs, t0=t0, t1=t1,
                          cpu=max(0.0, c1 - c0 - hooks))
        return run
    return make


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    if getattr(original, "_kvgeom_timed", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper._kvgeom_timed = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def install_kvgeom(module: Any, path: str) -> None:
    """Time ``module.ConnectorExecutor`` (``kvgeom_nixl.vllm.executor``): queued, post, done."""
    cls = module.ConnectorExecutor

    def pull(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, job: Any) -> Any:
            _started(str(job.request_id))
            _emit(path, kind="queued", connector="kvgeom", req=str(job.request_id), t=time.perf_counter())
            return original(self, job)
        return run

    def start_pull(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, job: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(self, job)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                _emit(path, kind="post", connector="kvgeom", req=str(job.request_id), tid=str(job.transfer_id),
                      t0=t0, t1=t1, cpu=c1 - c0, posted=job.request_id not in self._out.failed,
                      blocks=sum(len(g) for g in job.local_blocks))
        return run

    def d_finished(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, ep: Any) -> Any:
            before = {tid: job.request_id for tid, job in self._pulls.items()}
            try:
                return original(self, ep)
            finally:
                t = time.perf_counter()
                for tid, rid in before.items():
                    if tid not in self._pulls:
                        _emit(path, kind="done", connector="kvgeom", req=str(rid), t=t,
                              failed=rid in self._out.failed)
        return run

    def post_to(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, agent: str, notif_kind: str, *args: int) -> Any:
            if self.kind != "pull" or agent not in self.posters:
                return original(self, agent, notif_kind, *args)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(self, agent, notif_kind, *args)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                _emit(path, kind="post_part", connector="kvgeom", tid=str(self.request_id), t0=t0, t1=t1,
                      cpu=c1 - c0)
        return run

    if os.environ.get(BEFORE):
        _before(module)
    transfer: Any = getattr(module, "Transfer", None)  # (a stand-in's; the executor's is kvgeom_nixl.transfer's)
    if transfer is None:
        from kvgeom_nixl.transfer import Transfer

        transfer = Transfer
    _wrap(transfer, "_post_to", post_to)
    _wrap(cls, "pull", pull)
    _wrap(cls, "_start_pull", start_pull)
    _wrap(cls, "_d_finished", d_finished)


def install_kvgeom_engine(module: Any, path: str) -> None:
    """Time ``module.KvgeomWorker.start_load_kv`` (``kvgeom_nixl.vllm.worker``): engine."""
    _wrap(module.KvgeomWorker, "start_load_kv", _engine("kvgeom", path))


def _before(module: Any) -> None:
    """Put back the connector's per-request path as it was before the benchmark's fixes (for the
    ``kvgeom-before`` column): every request planned (no per-shape recipes), token-exact pulls (a
    partly filled last block moved row by row, and M - 1 tokens when M ends a block), READs only after
    P's grant (not eager), the 2 ms progress tick during transfers, the packed
    candidate counted with no staging ring, and ``for_decode_rank`` rebuilding (and re-checking) a
    plan that is that rank's already."""
    import attrs

    from kvgeom.planning import compiled
    from kvgeom.planning.packed import count_packed
    from kvgeom.values.plan import TransferPlan
    from kvgeom_nixl.vllm import pulls

    module.whole_pages = pulls.whole_pages = lambda pair, computed_tokens: computed_tokens  # type: ignore[assignment]
    pulls.full_attention_only = lambda pair: False  # (M - 1 planned when M ends a block, as before)
    pulls.PullSide._recipe_book = lambda self, engine, link: None  # type: ignore[method-assign]
    init = module.ConnectorExecutor.__init__

    def not_eager(self: Any, *args: Any, **kwargs: Any) -> None:  # (req, grant, then the READ)
        init(self, *args, **{**kwargs, "eager": False})

    module.ConnectorExecutor.__init__ = not_eager
    module.FAST_POLL_S = module.BUSY_POLL_S
    weigh = compiled.weigh_packed

    def weigh_packed(pair: Any, request: Any, staging_bytes: int, *args: Any) -> Any:
        try:
            count_packed(pair, request, staging_bytes)
        except Exception:  # noqa: BLE001 - (only its time is wanted: the result is weigh's)
            pass
        return weigh(pair, request, staging_bytes, *args)

    def for_decode_rank(self: Any, d_rank: int) -> Any:
        return attrs.evolve(
            self, copies=self.copies.take(self.copies.d_rank == d_rank),
            zeros=self.zeros.take(self.zeros.d_rank == d_rank),
            rearranges=tuple(r for r in self.rearranges if r.d_rank == d_rank),
            packs=tuple(x for x in self.packs if x.d_rank == d_rank),
            unpacks=tuple(x for x in self.unpacks if x.d_rank == d_rank),
            wire=self.wire.take(self.wire.d_rank == d_rank))

    compiled.weigh_packed = weigh_packed  # type: ignore[assignment]
    TransferPlan.for_decode_rank = for_decode_rank  # type: ignore[method-assign]


def install_nixl(module: Any, path: str) -> None:
    """Time ``module.NixlPullConnectorWorker`` (vLLM's ``...v1.nixl.pull_worker``): post, done, engine."""
    cls = module.NixlPullConnectorWorker

    def read_for_req(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, req_id: str, meta: Any) -> Any:
            _started(str(req_id))
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(self, req_id, meta)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                _emit(path, kind="post", connector="nixl", req=str(req_id), t0=t0, t1=t1, cpu=c1 - c0,
                      posted=bool(self._recving_transfers.get(req_id)),
                      blocks=sum(len(g) for g in (getattr(meta, "local_block_ids", None) or ())))
        return run

    def pop_done(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, transfers: dict[str, list[int]]) -> Any:
            out = original(self, transfers)
            if transfers is self._recving_transfers:
                t = time.perf_counter()
                done, failed = out
                for rid in done:
                    _emit(path, kind="done", connector="nixl", req=str(rid), t=t, failed=rid in failed)
            return out
        return run

    _wrap(cls, "_read_blocks_for_req", read_for_req)
    _wrap(cls, "_pop_done_transfers", pop_done)
    _wrap(cls, "start_load_kv", _engine("nixl", path))


def read_events(path: str | os.PathLike[str], offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The complete event lines of ``path`` from byte ``offset``, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


@dataclass(frozen=True)
class RequestTiming:
    """One D request on the worker (seconds): ``overhead`` the post's own work (plan + post), wall
    time, and ``overhead_cpu`` its thread's CPU time (what the load on a shared machine inflates
    least), ``queue_to_post`` from the engine thread's hand-off to the posted READ (kvgeom: the jobs
    thread's wait; vLLM: the same call, = ``overhead``), ``transfer`` from posted to seen done,
    ``engine_cpu`` the engine thread's CPU time in the ``start_load_kv`` that started the pull
    (shared evenly when one call started several)."""

    overhead: float
    overhead_cpu: float
    queue_to_post: float
    transfer: float
    blocks: int = 0  # D blocks the pull wrote
    engine_cpu: float = 0.0

def request_timings(events: Iterable[dict[str, Any]]) -> RequestTiming:
    """The timing of the ONE request pulled in ``events`` (the events one D request left).

    Raises ``ValueError`` unless there is exactly one posting post event, one done event after
    it, for the same request, not failed, and an engine event that started it: a benchmark row
    must come from a transfer that happened, timed on every thread.
    """
    evs = list(events)
    posts = [e for e in evs if e["kind"] == "post" and e.get("posted")]
    dones = [e for e in evs if e["kind"] == "done"]
    if len(posts) != 1 or len(dones) != 1:
        raise ValueError(f"expected one posted pull and one done, got {len(posts)} and {len(dones)}: {evs}")
    post, done = posts[0], dones[0]
    if post["req"] != done["req"] or done.get("failed"):
        raise ValueError(f"the pull of {post['req']!r} did not finish well: {done}")
    parts = [e for e in evs if e["kind"] == "post_part" and "tid" in post and e["tid"] == post["tid"]]
    # posted: when the READ went out (an eager READ, posted by the progress thread, may go out and
    # even finish before the post event ends: _start_pull goes on after posting, e.g. to learn a recipe)
    posted = max(e["t1"] for e in parts) if parts else post["t1"]
    if not post["t0"] <= post["t1"] or done["t"] < post["t0"]:
        raise ValueError(f"events out of order: post {post['t0']}..{post['t1']}, done {done['t']}")
    queued = [e["t"] for e in evs if e["kind"] == "queued" and e["req"] == post["req"]]
    start = min(queued) if queued else post["t0"]
    if posted > done["t"]:
        raise ValueError(f"the READ of {post['req']!r} was posted after it was seen done")
    engine = [e for e in evs if e["kind"] == "engine" and post["req"] in e["reqs"]]
    if not engine:
        raise ValueError(f"no engine-thread event (start_load_kv) started the pull of {post['req']!r}")
    return RequestTiming(overhead=post["t1"] - post["t0"] + sum(e["t1"] - e["t0"] for e in parts),
                         overhead_cpu=post["cpu"] + sum(e["cpu"] for e in parts),
                         queue_to_post=posted - start, transfer=done["t"] - posted, blocks=int(post.get("blocks", 0)),
                         engine_cpu=sum(e["cpu"] / len(e["reqs"]) for e in engine))
