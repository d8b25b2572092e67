"""Loaded by every Python process of an end-to-end test's vLLM instance (tests/vllm_pd.py puts this
directory first on its ``PYTHONPATH``): shortens how long vLLM's worker processes spin for the
next call.

vLLM's multiprocess executor (TP2 here) hands each step to its worker processes through a
shared-memory queue whose readers spin (``sched_yield``) for ``busy_loop_s`` = 1 s after every
read before they sleep on a socket. An engine that steps every few milliseconds (D waiting for its
KV, P holding blocks for D) keeps both workers spinning on both cores of this machine, and the
transfer they wait for, in other processes, starves. 10 ms keeps steps that follow each other
back to back without a socket wake-up. Nothing else is changed; the patch is applied when vLLM's
module is first imported (an import hook), so processes that never import it pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "vllm.distributed.device_communicators.shm_broadcast"
BUSY_LOOP_S = 0.01


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            init = getattr(getattr(module, "SpinCondition", None), "__init__", None)
            names = init.__code__.co_varnames[:init.__code__.co_argcount] if init is not None else ()
            if init is not None and init.__defaults__ and names[-len(init.__defaults__):][-1:] == ("busy_loop_s",):
                init.__defaults__ = (*init.__defaults__[:-1], BUSY_LOOP_S)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Patch())
