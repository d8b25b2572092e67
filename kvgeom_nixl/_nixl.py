"""The one place that imports NIXL: agent creation, error classification, environment defaults.

NIXL's exception classes (``nixl._bindings``) share no base class, so :func:`nixl_errors` lists
them and :func:`classify` maps one to a failure reason::

    nixlRemoteDisconnectError            -> "peer_disconnected"
    any other nixl*Error, KeyError (op)  -> "nixl_error"

Agents run without NIXL's progress thread by default (it busy-spins one core per agent): every
wait loop of the executor polls both sides instead.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["nixl_available", "make_agent", "nixl_errors", "classify", "use_local_defaults"]

_ERROR_NAMES = (
    "nixlNotFoundError", "nixlInvalidParamError", "nixlBackendError", "nixlRemoteDisconnectError",
    "nixlRepostActiveError", "nixlNoTelemetryError", "nixlNotAllowedError", "nixlNotPostedError",
    "nixlNotSupportedError", "nixlMismatchError", "nixlCancelledError", "nixlUnknownError",
)


def use_local_defaults() -> None:
    """Quiet NIXL's INFO lines on stdout and keep UCX on loopback, unless the user chose otherwise.

    For the CLI and the tests (one machine); call it before the first agent is made.
    """
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def make_agent(name: str, *, telemetry: bool = False, progress_thread: bool = False) -> Any:
    """A NIXL agent with the UCX backend."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread, capture_telemetry=telemetry)
    return nixl_agent(name, cfg)


_errors: tuple[type[BaseException], ...] | None = None


def nixl_errors() -> tuple[type[BaseException], ...]:
    """Every NIXL exception class (they derive directly from ``Exception``)."""
    global _errors
    if _errors is None:
        from nixl import _bindings

        _errors = tuple(getattr(_bindings, n) for n in _ERROR_NAMES if hasattr(_bindings, n))
    return _errors


def classify(exc: BaseException) -> str:
    """The failure reason for an exception raised by a NIXL call."""
    if type(exc).__name__ == "nixlRemoteDisconnectError":
        return "peer_disconnected"
    return "nixl_error"
