"""Loaded by every Python process of an end-to-end test's vLLM instance (tests/vllm_pd.py puts this
directory first on its ``PYTHONPATH``): two polling loops made to sleep, so that a dozen instances
fit on this 2-core machine. Neither changes what is computed or transferred, only how often idle
threads poll.

* vLLM's multiprocess executor (TP2 here) hands each step to its worker processes through a
  shared-memory queue whose readers spin (``sched_yield``) for ``busy_loop_s`` = 1 s after every
  read before they sleep on a socket: an engine that steps every few milliseconds keeps both
  workers spinning on both cores. Here they spin 10 ms, and each turn of the spin sleeps
  ``YIELD_SLEEP_S`` = 0.1 ms instead of calling ``sched_yield()``. On this VM's kernel (6.18,
  ``PREEMPT(none)``), a TP2 D whose engine steps empty while a request waits for its KV, with
  both workers yield-spinning on their pinned cores, starves every other task for 20-140 s now
  and then: the P instance, kernel threads (dmesg: ``workqueue lockup``, ``rcu_preempt kthread
  starved``) and a shell loop alike. Measured with one TP1 P -> TP2 D pair (KvgeomConnector, a
  request every ~0.1 s, 2026-12-02): with ``sched_yield`` 4 of 4 runs stalled within 1-5 min
  (D's pull times out at 120 s: P, starved, never grants it); with the 0.1 ms sleep 3010
  requests in 300 s, no stall. ``KVGEOM_E2E_YIELD_SLEEP_S=0`` restores vLLM's ``sched_yield``.
* NIXL 1.5.1's Python API creates every agent with ``pthrDelay = 0``: its progress thread (on by
  default, vLLM's NixlConnector uses it) spins one core per agent, idle or not (measured: an idle
  NixlConnector instance uses 100 % of a core, a KvgeomConnector one 3 %). Here it waits up to
  1 ms between polls (NIXL's own knob, in microseconds).

With ``KVGEOM_BENCH_TIMINGS`` set (``python -m benchmarks.vllm_connector`` does), D's connector
worker is also timed: :mod:`benchmarks.vllm_timing` wraps a few of its methods and appends events
to that file (nothing else changes).

Each patch is applied when its module is first imported (an import hook), so processes that never
import it (the metadata prober, for one) pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable
from typing import Any

BUSY_LOOP_S = 0.01
YIELD_SLEEP_S = float(os.environ.get("KVGEOM_E2E_YIELD_SLEEP_S", "0.0001"))
NIXL_PROGRESS_DELAY_US = 1000


def _spin_less(module: Any) -> None:
    init = getattr(getattr(module, "SpinCondition", None), "__init__", None)
    if init is None or not init.__defaults__:
        return
    names = init.__code__.co_varnames[:init.__code__.co_argcount]
    if names[-1:] == ("busy_loop_s",):
        init.__defaults__ = (*init.__defaults__[:-1], BUSY_LOOP_S)
    if YIELD_SLEEP_S > 0 and callable(getattr(module, "sched_yield", None)):
        module.sched_yield = _sleep_a_little


def _sleep_a_little() -> None:
    time.sleep(YIELD_SLEEP_S)


def _nixl_delay(module: Any) -> None:
    bind = getattr(module, "nixlBind", None)
    original = getattr(bind, "nixlAgent", None)
    if original is None:
        return

    def agent(name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = NIXL_PROGRESS_DELAY_US
        return original(name, config)

    bind.nixlAgent = agent


PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.distributed.device_communicators.shm_broadcast": _spin_less,
    "nixl_cu12._api": _nixl_delay,
    "nixl_cu13._api": _nixl_delay,
}


def _timed(which: str) -> Callable[[Any], None]:
    def install(module: Any) -> None:
        from benchmarks import vllm_timing

        getattr(vllm_timing, f"install_{which}")(module, os.environ["KVGEOM_BENCH_TIMINGS"])
    return install


if os.environ.get("KVGEOM_BENCH_TIMINGS"):
    PATCHES["kvgeom_nixl.vllm.executor"] = _timed("kvgeom")
    PATCHES["kvgeom_nixl.vllm.worker"] = _timed("kvgeom_engine")
    PATCHES["vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"] = _timed("nixl")


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Hook())
