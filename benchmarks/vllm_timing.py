"""Timing hooks on D's connector worker, for ``python -m benchmarks.vllm_connector``.

Installed by ``tests/vllm_e2e_site/sitecustomize.py`` in a vLLM instance's processes when
``KVGEOM_BENCH_TIMINGS`` names a file: each hook wraps one method of a connector's worker side
(library code is not changed) and appends one JSON line per event to that file:

* ``post``: the per-request work of posting D's pull, timed on the worker: ``t0``/``t1`` around
  it, ``cpu`` its thread's CPU time in it, ``posted`` whether a transfer was left in flight. kvgeom: ``ConnectorExecutor._start_pull``
  (build the request from the block tables, plan it, post the pull under the lock; on the jobs
  thread). vLLM's NixlConnector: ``NixlPullConnectorWorker._read_blocks_for_req`` (map the block
  ids, build the descriptor ids, ``make_prepped_xfer`` + ``transfer``; on the engine's thread).
* ``queued``: kvgeom only, when the engine thread hands the pull to the executor
  (``ConnectorExecutor.pull``; vLLM's connector posts in the same call, so its ``t0`` is that).
* ``done``: when the worker first sees the transfer finished (kvgeom: its progress thread's
  ``_d_finished``; vLLM: ``_pop_done_transfers`` of its receiving transfers, once per step).

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

__all__ = ["ENV", "install_kvgeom", "install_nixl", "RequestTiming", "request_timings", "read_events"]

ENV = "KVGEOM_BENCH_TIMINGS"
_WRITE = threading.Lock()


def _emit(path: str, **event: Any) -> None:
    line = json.dumps(event) + "\n"
    with _WRITE, open(path, "a") as f:
        f.write(line)


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
                _emit(path, kind="post", connector="kvgeom", req=str(job.request_id), t0=t0, t1=t1, cpu=c1 - c0,
                      posted=job.request_id not in self._out.failed)
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

    _wrap(cls, "pull", pull)
    _wrap(cls, "_start_pull", start_pull)
    _wrap(cls, "_d_finished", d_finished)


def install_nixl(module: Any, path: str) -> None:
    """Time ``module.NixlPullConnectorWorker`` (vLLM's ``...v1.nixl.pull_worker``): post, done."""
    cls = module.NixlPullConnectorWorker

    def read_for_req(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, req_id: str, meta: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(self, req_id, meta)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                _emit(path, kind="post", connector="nixl", req=str(req_id), t0=t0, t1=t1, cpu=c1 - c0,
                      posted=bool(self._recving_transfers.get(req_id)))
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
    thread's wait; vLLM: the same call, = ``overhead``), ``transfer`` from posted to seen done."""

    overhead: float
    overhead_cpu: float
    queue_to_post: float
    transfer: float


def request_timings(events: Iterable[dict[str, Any]]) -> RequestTiming:
    """The timing of the ONE request pulled in ``events`` (the events one D request left).

    Raises ``ValueError`` unless there is exactly one posting post event, one done event after
    it, for the same request, not failed: a benchmark row must come from a transfer that happened.
    """
    evs = list(events)
    posts = [e for e in evs if e["kind"] == "post" and e.get("posted")]
    dones = [e for e in evs if e["kind"] == "done"]
    if len(posts) != 1 or len(dones) != 1:
        raise ValueError(f"expected one posted pull and one done, got {len(posts)} and {len(dones)}: {evs}")
    post, done = posts[0], dones[0]
    if post["req"] != done["req"] or done.get("failed"):
        raise ValueError(f"the pull of {post['req']!r} did not finish well: {done}")
    if not post["t0"] <= post["t1"] <= done["t"]:
        raise ValueError(f"events out of order: post {post['t0']}..{post['t1']}, done {done['t']}")
    queued = [e["t"] for e in evs if e["kind"] == "queued" and e["req"] == post["req"]]
    start = min(queued) if queued else post["t0"]
    return RequestTiming(overhead=post["t1"] - post["t0"], overhead_cpu=post["cpu"],
                         queue_to_post=post["t1"] - start, transfer=done["t"] - post["t1"])
