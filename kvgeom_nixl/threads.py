"""The executor's threading model: one lock per endpoint, and a thread that keeps endpoints progressing.

    Endpoint(..., lock=None)        every public call of the endpoint, its links and its transfers
                                    holds ``endpoint.lock`` (a ``threading.RLock``; pass one lock to
                                    several endpoints to serialise them together)
    Progressor(*endpoints)          a daemon thread: endpoint.progress() every ``interval_s``
      .start() / .stop()            (each call under that endpoint's lock), so that a rank whose
      with Progressor(ep): ...      engine is idle still answers its peers (grants, READ
                                    notifications, heartbeats) and its transfers meet their deadlines

NIXL runs without its own progress thread (it busy-spins a core per agent, docs/design.md §8), and
UCX over TCP moves data only while both workers progress, so a P rank nobody polls stalls every
pull from it. A connector either calls ``progress()`` (or ``get_finished()``) from its own step
loop, or starts a :class:`Progressor`; both may run at once, since every entry point takes the
lock. State read without the lock (``transfer.settled``, ``transfer.done``) is a single attribute
read, safe under the GIL.

Worked number: a Progressor with ``interval_s=0.001`` over one idle endpoint costs about one
``progress()`` (a few microseconds) per millisecond: well under 1 % of a core.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from kvgeom.values import check_seconds

from .errors import ExecutorError

__all__ = ["Progressor", "locked", "DEFAULT_INTERVAL_S"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1e-3

P = ParamSpec("P")
R = TypeVar("R")


class _HasLock(Protocol):
    @property
    def lock(self) -> threading.RLock: ...


S = TypeVar("S", bound=_HasLock)


def locked(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` holding ``self.lock`` (reentrant: a locked method may call another)."""

    @functools.wraps(method)
    def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class _Progressing(Protocol):
    closed: bool

    def progress(self) -> None: ...


class Progressor:
    """A daemon thread that calls ``progress()`` on each endpoint every ``interval_s`` seconds.

    Each call takes that endpoint's lock, so the caller's thread may keep using the endpoints
    (posting, ``get_finished``) at the same time. An exception in ``progress`` (a bug: progress
    records transfer failures instead of raising) is logged, kept in :attr:`errors`, and stops the
    thread. Closed endpoints are skipped; :meth:`stop` joins the thread.
    """

    def __init__(self, *endpoints: _Progressing, interval_s: float = DEFAULT_INTERVAL_S,
                 name: str = "kvgeom-progress") -> None:
        if not endpoints:
            raise ExecutorError("endpoints", "a Progressor needs at least one endpoint", fix="Progressor(endpoint)")
        self.endpoints = tuple(endpoints)
        self.interval_s = check_seconds("interval_s", interval_s, error=ExecutorError)
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> Progressor:
        """Start the thread (once); returns self."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to stop after its current round and wait for it (at most ``timeout_s``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            for ep in self.endpoints:
                if ep.closed:
                    continue
                try:
                    ep.progress()
                except Exception as e:  # noqa: BLE001 - reported, then the thread ends
                    logger.error("progress thread: %s on %r: %s", type(e).__name__, ep, e)
                    self.errors.append(e)
                    return
            if all(ep.closed for ep in self.endpoints):
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Progressor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Progressor({len(self.endpoints)} endpoints, every {self.interval_s * 1e3:g} ms, {state})"
