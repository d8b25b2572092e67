"""Peer metadata is parsed by NIXL in a separate process first: a hostile blob can crash NIXL.

NIXL 1.5's metadata loader trusts the blob it is given. The hostile-handshake campaign
(``benchmarks/hostile.py``) found two ways a peer's blob hurts the process that loads it:

* a blob whose memory sections fail to load leaves its UCX connection behind, under the peer's
  agent name, and no call removes it: every later load of that peer, even an honest one, fails
  (``NIXL_ERR_INVALID_PARAM``) until the process restarts;
* a blob with one flipped byte in a section's fields makes ``add_remote_agent`` crash the process
  (SIGSEGV), taking every engine rank in it down.

So an endpoint never gives a blob to its own agent before a *prober* process has loaded it (and
unloaded it) in a scratch agent::

    Endpoint.connect --probe(blob)--> MetadataProber (one per process, started on first use)
                                        child: python kvgeom_nixl/probe.py  (a UCX agent, no memory)
                     <-- agent name ---    add_remote_agent(blob); remove_remote_agent(name)
                     <-- refused ------    a NIXL error, a non-UTF-8 name, a crash (SIGSEGV) or 10 s
    then the endpoint's own agent loads the blob (the same NIXL, the same backends: it loads)

A crashed or hung prober is restarted on the next probe; the blob that caused it is refused
(:class:`~kvgeom_nixl.errors.HandshakeError`). The protocol over the child's stdin/stdout is
length-prefixed frames: the blob in, a JSON answer out.

An endpoint starts the prober in a background thread when it is made (``warm_prober=True``,
:meth:`MetadataProber.warm_async`), so the first ``connect`` does not pay for the start.

Worked number: starting the prober costs about 0.6 s on an idle 2-core machine (1.1 s under load:
a Python process importing NIXL and making one agent), once per process; a probe then costs about
1 ms. The child imports the NIXL flavour module its parent loaded (:func:`nixl_module`), never the
``nixl`` meta package, whose import brings torch in to find the CUDA version: in vLLM's venv, at
load 30, the start took 7.0 s through the meta package and 1.3 s with the flavour module
(``tests/test_vllm_prober.py`` prints both). ``benchmarks/connect.py``: the first connect 1 s after the endpoint was made takes 751 ms
before, 21 ms after (idle machine; 1.2 s and 36 ms at load 19).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["MetadataProber", "ProbeRefused", "ProberUnavailable", "prober", "nixl_module", "FLAVOURS", "PROBE_TIMEOUT_S"]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0  # a probe (or the prober's start) that takes longer is refused and the prober killed
_HEADER = struct.Struct("<Q")
MAX_FRAME = 16 << 20
FLAVOURS = ("nixl_cu13._api", "nixl_cu12._api")  # NIXL's API modules, one per CUDA flavour wheel


def nixl_module() -> str:
    """The NIXL API module this process loaded (``nixl._api`` is the flavour's module itself, put
    there by the meta package), or ``""`` when none is loaded yet.

    The child imports that module directly: the same NIXL as its parent, without the meta package's
    ``import nixl``, which imports torch to find the CUDA version (3.8 s against 0.55 s here, under
    load; a prober that starts in 20 s under load leaves P's first handshake waiting)."""
    for name in ("nixl._api", *FLAVOURS):
        module = sys.modules.get(name)
        if module is not None and module.__name__ in FLAVOURS:
            return module.__name__
    return ""


class ProbeRefused(Exception):
    """The prober refused a blob (NIXL refused it, crashed on it, or did not answer in time)."""


class ProberUnavailable(Exception):
    """The prober process could not be started (the caller probes in process instead)."""


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the prober exited")
        out += chunk
    return bytes(out)


class MetadataProber:
    """A child process that loads (and unloads) peer metadata blobs in a scratch NIXL agent."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S, *, nixl_module: str | None = None) -> None:
        """``nixl_module``: the NIXL API module the child imports (one of :data:`FLAVOURS`, or ``""``
        for the meta package's choice); default: the one this process loaded (:func:`nixl_module`)."""
        if nixl_module not in (None, "", *FLAVOURS):
            from kvgeom_nixl.errors import ExecutorError  # (this file also runs as the child's script: no package)

            raise ExecutorError("nixl_module", f"{nixl_module!r} is not a NIXL API module", actual=nixl_module,
                                expected=f"one of {FLAVOURS}, or '' for the meta package's choice",
                                fix="leave it out: the child imports the module this process loaded")
        self.timeout_s = timeout_s
        self.nixl_module = nixl_module
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._warming: threading.Thread | None = None
        self.restarts = 0

    def _start(self) -> subprocess.Popen[bytes]:
        """Start the child and wait for its ready frame (it has imported NIXL and made its agent)."""
        module = self.nixl_module if self.nixl_module is not None else nixl_module()
        try:
            # run this file as a script: the child imports NIXL, not kvgeom_nixl (and so not torch)
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), module],  # noqa: S603
                                    stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(os.environ),
                                    close_fds=True)
        except OSError as e:
            raise ProberUnavailable(f"cannot start the prober: {e}") from None
        try:  # a child inherits its parent's CPU affinity: a vLLM worker pinned to one core that its
            # OpenMP threads keep busy would starve the prober's start for minutes; let it run anywhere
            os.sched_setaffinity(proc.pid, range(os.cpu_count() or 1))
        except (AttributeError, OSError):  # (no such call here, or a cpuset that forbids it: keep the parent's)
            pass
        try:
            if proc.stdout is None:
                raise EOFError("no pipe")
            deadline = time.monotonic() + self.timeout_s
            size = _HEADER.unpack(_read_exactly(proc.stdout.fileno(), _HEADER.size, deadline))[0]
            ready = json.loads(_read_exactly(proc.stdout.fileno(), min(size, MAX_FRAME), deadline))
            if not ready.get("ready"):
                raise EOFError(str(ready))
        except (OSError, EOFError, TimeoutError, ValueError) as e:
            self._proc = proc
            self._stop()
            raise ProberUnavailable(f"the prober did not start: {type(e).__name__}: {e}") from None
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            proc.kill()
            proc.wait(5)
        except Exception:  # noqa: BLE001,S110 - best effort: it may be gone already
            pass

    def _restart_soon(self) -> None:
        """Start the next prober in the background, so that the probe after a crash does not wait for it
        (the caller holds the lock; the thread takes it)."""

        def start() -> None:
            with self._lock:
                if self._proc is None:
                    try:
                        self._proc = self._start()
                        self.restarts += 1
                    except ProberUnavailable:
                        pass

        threading.Thread(target=start, name="kvgeom-prober-restart", daemon=True).start()

    def warm(self) -> None:
        """Start the prober now (a connect would start it on its first probe)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()

    def warm_async(self) -> None:
        """Start the prober in a background thread, once per process (an endpoint does this when it is
        made, so that its first ``connect`` finds the prober ready instead of waiting about a second
        for it); a probe that comes first waits for the start on the lock. A failed start is left to
        the first probe, which tries again."""
        if self._warming is not None or self._proc is not None:
            return

        def start() -> None:
            try:
                self.warm()
            except ProberUnavailable as e:
                logger.warning("the prober did not start in the background: %s", e)

        self._warming = threading.Thread(target=start, name="kvgeom-prober-start", daemon=True)
        self._warming.start()

    def probe(self, metadata: bytes) -> str:
        """The agent name NIXL loads ``metadata`` under, proven in the child; raises :class:`ProbeRefused`
        (and :class:`ProberUnavailable` when the child cannot be started at all)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._stop()
                    self.restarts += 1
                self._proc = self._start()
            proc = self._proc
            if proc.stdin is None or proc.stdout is None:
                raise ProbeRefused("the prober has no pipes")
            deadline = time.monotonic() + self.timeout_s
            try:
                proc.stdin.write(_HEADER.pack(len(metadata)) + metadata)
                proc.stdin.flush()
                size = _HEADER.unpack(_read_exactly(proc.stdout.fileno(), _HEADER.size, deadline))[0]
                if size > MAX_FRAME:
                    raise EOFError(f"an answer of {size} bytes")
                answer = json.loads(_read_exactly(proc.stdout.fileno(), size, deadline))
            except (OSError, EOFError, TimeoutError, ValueError) as e:
                try:
                    code: int | None = proc.wait(1.0) if isinstance(e, EOFError) else proc.poll()
                except subprocess.TimeoutExpired:
                    code = None
                self._stop()
                why = f"NIXL crashed on it (the prober exited with {code})" if code is not None else \
                    f"the prober did not answer ({type(e).__name__}: {e})"
                logger.warning("peer metadata refused: %s; restarting the prober", why)
                self._restart_soon()
                raise ProbeRefused(why) from None
            if not answer.get("ok"):
                raise ProbeRefused(str(answer.get("error", "refused"))[:300])
            raw = base64.b64decode(answer["name"])
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ProbeRefused("the metadata names an agent that is not UTF-8 text") from None

    def close(self) -> None:
        with self._lock:
            self._stop()


_prober: MetadataProber | None = None
_prober_lock = threading.Lock()


def prober() -> MetadataProber:
    """The process's prober (started on its first probe)."""
    global _prober
    with _prober_lock:
        if _prober is None:
            _prober = MetadataProber()
        return _prober


def _nixl_classes(module: str) -> tuple[Any, Any]:
    """``nixl_agent`` and ``nixl_agent_config`` from ``module`` (one of :data:`FLAVOURS`: the parent's),
    else as kvgeom_nixl.agent.nixl_api finds them: the meta package, else one CUDA flavour alone."""
    if module == "nixl_cu13._api":
        import nixl_cu13._api as api
    elif module == "nixl_cu12._api":
        import nixl_cu12._api as api  # type: ignore[no-redef]
    else:
        try:
            import nixl._api as api  # type: ignore[no-redef]
        except ImportError:
            try:
                import nixl_cu13._api as api  # type: ignore[no-redef]
            except ImportError:
                import nixl_cu12._api as api  # type: ignore[no-redef]
    return api.nixl_agent, api.nixl_agent_config


def _serve(module: str = "") -> int:
    """The child: answer every framed blob on stdin with ``{"ok", "name" | "error"}`` on stdout."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    # answers go to a private copy of stdout; fd 1 itself goes where stderr goes (UCX writes its error
    # lines to stdout, which would corrupt the frames)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    nixl_agent, nixl_agent_config = _nixl_classes(module)

    def make_agent(name: str) -> Any:  # as kvgeom_nixl.agent.make_agent (this script imports no package)
        return nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))

    inp, out = sys.stdin.buffer, answers
    n = 1
    agent: Any = make_agent(f"kvgeom-probe-{os.getpid()}-{n}")
    ready = json.dumps({"ready": True}).encode()
    out.write(_HEADER.pack(len(ready)) + ready)
    out.flush()
    while True:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return 0  # the parent closed the pipe
        size = _HEADER.unpack(head)[0]
        if size > MAX_FRAME:
            return 1
        blob = inp.read(size)
        if agent is None:
            n += 1
            agent = make_agent(f"kvgeom-probe-{os.getpid()}-{n}")
        try:
            raw = agent.add_remote_agent(blob)
            name = raw if isinstance(raw, (bytes, bytearray)) else str(raw).encode("utf-8", "surrogateescape")
            try:
                agent.remove_remote_agent(raw)
            except Exception:  # noqa: BLE001 - a name it cannot remove: use a fresh scratch agent next time
                agent = None
            answer: dict[str, Any] = {"ok": True, "name": base64.b64encode(bytes(name)).decode("ascii")}
        except Exception as e:  # noqa: BLE001 - NIXL's errors share no base class
            agent = None  # it may hold the refused blob's connection: the next probe gets a fresh agent
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        data = json.dumps(answer).encode()
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1] if len(sys.argv) > 1 else ""))
