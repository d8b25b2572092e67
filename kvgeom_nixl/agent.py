"""One rank's NIXL agent: the only module that imports NIXL.

A :class:`RankAgent` owns one ``nixl_agent`` (UCX backend) and everything that lives in it: the
registration of the rank's regions, the peer agents it loaded, its prepared descriptor tables,
and the notifications it received::

    RankAgent(name, region descs, mem_type)     nixl_agent + register_memory (once, whole regions)
      .metadata()                        -> bytes for the handshake
      .probe(metadata) -> name           loaded into a scratch agent (in the prober process) and
                                         unloaded: a blob NIXL refuses never reaches this agent
      .add_peer(metadata) -> name        loaded into this agent (after a probe)
      .remove_peer(name)                 (also releases that peer's tables)
      .prepared(peer, tile) / .prepare(peer, tile, descs, mem_type)   one table per (agent, tile)
      .post_coalesced(op, local, remote, ...)   initialize_xfer + transfer   -> handle (PROC)
      .post_prepped(op, table, idx, table, idx) make_prepped_xfer + transfer -> handle (PROC)
      .state(handle) -> "PROC" | "DONE" | ...   .descriptor_count(handle) (telemetry)   .release(handle)
      .send(peer, message)               a standalone notification (the protocol's messages)
      .drain() -> [(sender, bytes)]      get_new_notifs; verified and routed by the endpoint's inbox
      .close()                           release tables, deregister

Messages are built, signed and verified by :mod:`kvgeom_nixl.protocol` and routed by
:mod:`kvgeom_nixl.inbox`; this module only moves their bytes.

**Loading a peer's metadata.** NIXL 1.5 loads a metadata blob in two steps, the UCX connection
first and the memory sections second; when the second fails (a truncated or corrupted blob), the
connection stays behind under the peer's agent name and no call removes it, so every later load
of that peer, even an honest one, fails with ``NIXL_ERR_INVALID_PARAM``; and one flipped byte in a
section can crash the process. The endpoint therefore :meth:`probe`s every blob in a scratch
agent of a separate prober process (:mod:`kvgeom_nixl.probe`) before :meth:`add_peer` loads it
here; a refused or crashing blob, or one whose agent name is not the payload's, leaves this agent
and this process untouched.

NIXL's exception classes (``nixl._bindings``) share no base class, so :func:`nixl_errors` lists
them and :func:`classify` maps one to a failure reason (``nixlRemoteDisconnectError`` ->
``"peer_disconnected"``, any other -> ``"nixl_error"``). Agents run without NIXL's progress
thread by default (it busy-spins one core per agent): the executor's wait loops poll instead
(docs/design.md §8).

Worked number: a D rank that pulled request ``r1`` from P ranks 0 and 1 posts two READs, each
carrying a signed ``pulled`` message (about 100 bytes) that NIXL delivers after the data.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Any

import numpy as np

from kvgeom import MissingExtra, install_hint

from .errors import ExecutorError
from .probe import ProbeRefused, ProberUnavailable, prober

logger = logging.getLogger(__name__)

__all__ = ["RankAgent", "nixl_available", "nixl_api", "NIXL_PACKAGES", "make_agent", "nixl_errors", "classify",
           "use_local_defaults", "set_nixl_log_level", "NIXL_LOG_LEVEL"]

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


NIXL_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
"""Where NIXL's Python API may live, in the order tried: the ``nixl`` meta package (which installs
both CUDA flavours and picks one at import), else one flavour installed alone (``nixl-cu13`` or
``nixl-cu12``, e.g. the ``nixl-cu12`` extra, or ``dev`` on a CPU machine)."""

_api: Any = None


def nixl_api() -> Any:
    """NIXL's ``_api`` module from the first of :data:`NIXL_PACKAGES` installed; :class:`kvgeom.MissingExtra`
    naming the pip command when none is."""
    global _api
    if _api is None:
        missing: list[str] = []
        for pkg in NIXL_PACKAGES:
            try:
                if pkg == "nixl":
                    import nixl._api as api
                elif pkg == "nixl_cu13":
                    import nixl_cu13._api as api  # type: ignore[no-redef]
                else:
                    import nixl_cu12._api as api  # type: ignore[no-redef]
            except ImportError as e:
                if getattr(e, "name", None) not in (pkg, f"{pkg}._api"):
                    raise  # the package is there but broken: its own error says why
                missing.append(pkg)
                continue
            _api = api
            break
        else:
            raise MissingExtra("nixl", "an endpoint needs NIXL, which is not installed", actual=missing,
                               expected="one of the packages nixl, nixl-cu13, nixl-cu12",
                               fix=f"{install_hint('nixl')} (or the nixl-cu12 / nixl-cu13 extra for one CUDA flavour)")
    return _api


def nixl_available() -> bool:
    """Whether NIXL's Python API can be imported (:func:`nixl_api`)."""
    try:
        nixl_api()
    except ImportError:
        return False
    return True


NIXL_LOG_LEVEL = "WARN"
"""The level kvgeom_nixl gives NIXL's Python logger (``nixl``) when the environment variable
``NIXL_LOG_LEVEL`` is unset: NIXL itself logs at INFO to stdout (``Backend UCX was instantiated``,
``Initialized NIXL agent``), and a library must not print. Set ``NIXL_LOG_LEVEL=INFO`` (read by
NIXL and left alone here) to see those lines, or assign this constant before the first agent."""

_nixl_level_set = False


def set_nixl_log_level() -> None:
    """Give NIXL's ``nixl`` logger :data:`NIXL_LOG_LEVEL`, once, unless ``NIXL_LOG_LEVEL`` is set.

    Called after ``nixl._api`` is imported (its import configures that logger at INFO on stdout)
    and before an agent is made, so the agent's INFO lines never reach stdout."""
    global _nixl_level_set
    if _nixl_level_set or os.environ.get("NIXL_LOG_LEVEL"):
        return
    levels = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
              "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}  # NIXL's names for its levels
    level = levels.get(str(NIXL_LOG_LEVEL).upper())
    if level is None:
        raise ExecutorError("NIXL_LOG_LEVEL", f"unknown NIXL log level {NIXL_LOG_LEVEL!r}", actual=NIXL_LOG_LEVEL,
                            expected=list(levels), fix='e.g. kvgeom_nixl.agent.NIXL_LOG_LEVEL = "WARN"')
    logging.getLogger("nixl").setLevel(level)
    _nixl_level_set = True


def make_agent(name: str, *, telemetry: bool = False, progress_thread: bool = False) -> Any:
    """A bare NIXL agent with the UCX backend (NIXL's logger at :data:`NIXL_LOG_LEVEL` first).
    Without NIXL, :class:`kvgeom.MissingExtra` names the pip command."""
    api = nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    set_nixl_log_level()
    cfg = nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread, capture_telemetry=telemetry)
    return nixl_agent(name, cfg)


_errors: tuple[type[BaseException], ...] | None = None


def nixl_errors() -> tuple[type[BaseException], ...]:
    """Every NIXL exception class (they derive directly from ``Exception``)."""
    global _errors
    if _errors is None:
        _bindings = sys.modules[nixl_api().__name__.rsplit(".", 1)[0] + "._bindings"]  # imported by _api

        _errors = tuple(getattr(_bindings, n) for n in _ERROR_NAMES if hasattr(_bindings, n))
    return _errors


def classify(exc: BaseException) -> str:
    """The failure reason for an exception raised by a NIXL call."""
    if type(exc).__name__ == "nixlRemoteDisconnectError":
        return "peer_disconnected"
    return "nixl_error"


def _name(agent_result: Any) -> str:
    return agent_result.decode() if isinstance(agent_result, (bytes, bytearray)) else str(agent_result)


def _release(handle: Any) -> None:
    try:
        handle.release()
    except Exception:  # noqa: BLE001,S110 - best effort at teardown
        pass


class RankAgent:
    """One rank's NIXL agent, its registered regions, prepared tables and notification inbox.

    ``regions`` is the Nx3 ``(addr, nbytes, device)`` array of the rank's regions
    (:meth:`RankMemory.descs`), registered whole, once. ``nixl`` is the bare agent (``None`` once
    closed).
    """

    def __init__(self, name: str, regions: np.ndarray, mem_type: str, *, telemetry: bool = False,
                 progress_thread: bool = False) -> None:
        self.name = name
        self.mem_type = mem_type
        self.telemetry = telemetry
        self._tables: dict[tuple[str, int], Any] = {}  # (agent, tile) -> prepared descriptor list
        self._probe: Any = None  # the scratch agent peer metadata is loaded into first
        nixl = make_agent(name, telemetry=telemetry, progress_thread=progress_thread)
        try:
            self._reg = nixl.register_memory(regions, mem_type)
        except nixl_errors() as e:
            raise ExecutorError("regions", f"NIXL refused to register the regions: {type(e).__name__}: {e}",
                                fix="check the memory type (a host pointer cannot be VRAM)") from e
        self.nixl: Any = nixl

    @property
    def closed(self) -> bool:
        return self.nixl is None

    # ---- peers -----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's NIXL metadata, for a peer's :meth:`add_peer`."""
        return bytes(self.nixl.get_agent_metadata())

    def probe(self, metadata: bytes) -> str:
        """Load ``metadata`` into a scratch agent and unload it: the name NIXL would load it under, or
        :class:`~kvgeom_nixl.probe.ProbeRefused`, without touching this agent (see the module docstring).

        The scratch agent lives in the process's prober (:mod:`kvgeom_nixl.probe`), because a
        hostile blob can crash NIXL. Where no prober process can be started, one scratch agent of
        this process serves instead (it keeps this agent from being poisoned, not the process from
        a crash), until a blob is refused or this agent closes.
        """
        try:
            return prober().probe(metadata)
        except ProberUnavailable as e:
            logger.warning("%s: probing peer metadata in process: %s", self.name, e)
        if self._probe is None:
            self._probe = make_agent(f"{self.name}-probe-{uuid.uuid4().hex[:8]}")
        try:
            raw = self._probe.add_remote_agent(metadata)
        except nixl_errors() as e:
            self._probe = None  # possibly poisoned for that peer's name: the next probe makes a fresh one
            raise ProbeRefused(f"{type(e).__name__}: {e}") from None
        self._probe.remove_remote_agent(raw)
        try:
            return _name(raw)
        except UnicodeDecodeError:
            raise ProbeRefused("the metadata names an agent that is not UTF-8 text") from None

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns the name NIXL loaded it under (raises NIXL errors).

        Call :meth:`probe` first: a blob NIXL refuses must not reach this agent.
        """
        return _name(self.nixl.add_remote_agent(metadata))

    def remove_peer(self, name: str) -> None:
        """Release the peer's prepared tables and forget the peer (best effort: it may be gone)."""
        for key in [k for k in self._tables if k[0] == name]:
            _release(self._tables.pop(key))
        if self.nixl is None:
            return
        try:
            self.nixl.remove_remote_agent(name)
        except Exception:  # noqa: BLE001,S110 - the peer may already be gone
            pass

    # ---- prepared tables -------------------------------------------------------------------
    def prepared(self, peer: str, tile: int) -> Any | None:
        """The table prepared for ``peer`` (``""``: this agent's own regions) and ``tile``, if any."""
        return self._tables.get((peer, tile))

    def prepare(self, peer: str, tile: int, descs: np.ndarray, mem_type: str) -> Any:
        """Prepare (once) the descriptor table ``descs`` of ``peer``'s memory (``""``: this agent's)."""
        handle = self.nixl.prep_xfer_dlist(peer, descs, mem_type)
        self._tables[(peer, tile)] = handle
        return handle

    def prepared_tables(self) -> dict[tuple[str, int], Any]:
        """Every prepared table by ``(agent, tile)`` (``""`` for this agent's own)."""
        return dict(self._tables)

    # ---- requests --------------------------------------------------------------------------
    def post_coalesced(self, op: str, local: np.ndarray, remote: np.ndarray, remote_mem: str, peer: str,
                       notif: bytes) -> Any:
        """Post ``op`` (READ | WRITE) over two Nx3 descriptor arrays (``initialize_xfer``: NIXL does not merge)."""
        handle = self.nixl.initialize_xfer(op, self.nixl.get_xfer_descs(local, self.mem_type),
                                           self.nixl.get_xfer_descs(remote, remote_mem), peer, notif)
        return self._start(handle)

    def post_prepped(self, op: str, local_table: Any, local_idx: np.ndarray, remote_table: Any,
                     remote_idx: np.ndarray, notif: bytes) -> Any:
        """Post ``op`` from index lists into two prepared tables (NIXL merges +1 runs; int32 indices,
        exact because tables are capped)."""
        handle = self.nixl.make_prepped_xfer(op, local_table, np.ascontiguousarray(local_idx, dtype=np.int32),
                                             remote_table, np.ascontiguousarray(remote_idx, dtype=np.int32), notif)
        return self._start(handle)

    def _start(self, handle: Any) -> Any:
        """Start a request; on any failure release its handle before raising."""
        try:
            state = self.nixl.transfer(handle)
        except BaseException:
            _release(handle)
            raise
        if state == "ERR":
            _release(handle)
            raise RuntimeError("NIXL refused to post the request")
        return handle

    def release(self, handle: Any) -> None:
        """Release a request's handle (idempotent; raises what NIXL raises)."""
        handle.release()

    def state(self, handle: Any) -> str:
        """``"PROC"``, ``"DONE"`` or NIXL's error state for a posted request."""
        return str(self.nixl.check_xfer_state(handle))

    def descriptor_count(self, handle: Any) -> int:
        """Descriptors NIXL used for a finished request, after its merges (needs ``telemetry``)."""
        return int(self.nixl.get_xfer_telemetry(handle).descCount)

    # ---- notifications ---------------------------------------------------------------------
    def send(self, peer: str, message: bytes) -> None:
        """Send a standalone notification to ``peer`` (raises NIXL's errors, e.g. a dead peer)."""
        self.nixl.send_notif(peer, message)

    def drain(self) -> list[tuple[str, bytes]]:
        """Every notification that arrived, as (sender agent, bytes); a NIXL error reads as none. The
        endpoint verifies and routes them (:mod:`kvgeom_nixl.inbox`): nothing is kept here."""
        if self.nixl is None:
            return []
        try:
            notifs = self.nixl.get_new_notifs()
        except nixl_errors():
            return []
        return [(_name(sender), bytes(m)) for sender, msgs in notifs.items() for m in msgs]

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Release every prepared table, deregister the regions, drop the agent."""
        if self.nixl is None:
            return
        for handle in self._tables.values():
            _release(handle)
        self._tables.clear()
        try:
            self.nixl.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001,S110 - best effort at teardown
            pass
        self._reg = None
        self.nixl = None
        self._probe = None
