"""The connector's side channel: a small TCP socket per P worker rank (docs/design.md §15.3).

Two messages cross it, both one length-prefixed JSON frame each way:

* ``{"op": "handshake"}`` -> ``{"payload": <base64 of Endpoint.handshake()>}``: D's worker rank
  fetches the payload of every P rank once per remote engine, then builds its link from them.
* ``{"op": "release", "request": <P's request id>, "d_rank": r, "d_tp": n}`` -> ``{"ok": true}``:
  a D rank is done with a request (its pull finished, failed or was never needed); P frees the
  request's blocks once all ``n`` D ranks said so (or its lease expires).

Everything read from the socket is hostile (docs/design.md §14): frames beyond ``MAX_FRAME`` bytes,
non-JSON, wrong types and unbounded release tables are refused with :class:`SideChannelError`
naming the field; the server drops that connection and keeps serving. Threading: the listener
runs in one daemon thread and touches only its own lock-protected release table and the handshake
bytes fixed at start; the executor's endpoints are used by the worker's thread alone.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time
from typing import Any

from kvgeom_nixl.errors import ExecutorError

__all__ = ["MAX_FRAME", "MAX_PENDING", "SideChannelError", "SideChannelServer", "fetch_handshake", "send_release"]

MAX_FRAME = 16 << 20  # a handshake payload of a large engine is ~100 KB; 16 MiB bounds a hostile one
MAX_PENDING = 100_000  # release entries kept for requests P has not yet been told about
PENDING_TTL_S = 3600.0
IO_TIMEOUT_S = 60.0  # generous: on a loaded host a worker thread can stall for seconds
_LEN = struct.Struct("!I")


class SideChannelError(ExecutorError):
    """A side-channel peer sent something this end refuses, or could not be reached."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise SideChannelError("frame", f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise SideChannelError("frame.length", f"a {n}-byte frame is beyond the limit", actual=n,
                               expected=f"<= {MAX_FRAME}")
    try:
        msg = json.loads(_recv_exact(sock, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise SideChannelError("frame", f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise SideChannelError("frame", f"a frame is a JSON object, got {type(msg).__name__}")
    return msg


def write_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _int_field(msg: dict[str, Any], name: str, lo: int, hi: int) -> int:
    v = msg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SideChannelError(f"release.{name}", f"expected an integer in [{lo}, {hi}], got {v!r:.60}",
                               actual=repr(v)[:60], expected=f"{lo} <= {name} <= {hi}")
    return v


class SideChannelServer:
    """One P worker rank's listener: serves its handshake payload and collects D's releases."""

    def __init__(self, host: str, port: int, payload: bytes) -> None:
        self._payload = base64.b64encode(payload).decode()
        self._lock = threading.Lock()
        self._released: dict[str, tuple[float, int, set[int]]] = {}  # request -> (first seen, d_tp, d ranks)
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise SideChannelError("KVGEOM_SIDE_CHANNEL_PORT", f"cannot listen on {host}:{port}: {e}", actual=port,
                                   fix="give each engine its own port (TP rank r listens on port + r), "
                                   "outside the ephemeral range") from None
        self._sock.settimeout(0.5)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvgeom-side-channel-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    write_frame(conn, self._answer(read_frame(conn)))
                except (SideChannelError, OSError) as e:  # a hostile or broken peer: drop it, keep serving
                    try:
                        write_frame(conn, {"error": str(e)[:500]})
                    except OSError:
                        pass

    def _answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "handshake":
            return {"payload": self._payload}
        if op == "release":
            req = msg.get("request")
            if not isinstance(req, str) or not 0 < len(req) <= 512:
                raise SideChannelError("release.request", f"a request id is a string of 1-512 characters, got {req!r:.60}")
            d_tp = _int_field(msg, "d_tp", 1, 4096)
            d_rank = _int_field(msg, "d_rank", 0, d_tp - 1)
            with self._lock:
                self._prune()
                if req not in self._released and len(self._released) >= MAX_PENDING:
                    raise SideChannelError("release", f"{MAX_PENDING} releases pending, refusing more")
                seen, tp, ranks = self._released.setdefault(req, (time.monotonic(), d_tp, set()))
                if tp != d_tp:
                    raise SideChannelError("release.d_tp", f"request {req!r:.60} was released with d_tp {tp}",
                                           actual=d_tp, expected=tp)
                ranks.add(d_rank)
            return {"ok": True}
        raise SideChannelError("op", f"unknown op {op!r:.60}", actual=repr(op)[:60], expected=["handshake", "release"])

    def _prune(self) -> None:
        cutoff = time.monotonic() - PENDING_TTL_S
        for req in [r for r, (seen, _, _) in self._released.items() if seen < cutoff]:
            del self._released[req]

    def released(self, request: str) -> bool:
        """Whether every D rank has released ``request`` (and forget it if so)."""
        with self._lock:
            entry = self._released.get(request)
            if entry is None or len(entry[2]) < entry[1]:
                return False
            del self._released[request]
            return True

    def forget(self, request: str) -> None:
        with self._lock:
            self._released.pop(request, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._released)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2.0)


def _call(host: str, port: int, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            write_frame(s, msg)
            reply = read_frame(s)
    except OSError as e:
        raise SideChannelError("side_channel", f"{host}:{port} unreachable: {type(e).__name__}: {e}",
                               fix="check remote_host/remote_port and that the P instance is running") from None
    if "error" in reply:
        raise SideChannelError("side_channel", f"{host}:{port} refused {msg.get('op')}: {str(reply['error'])[:300]}")
    return reply


def fetch_handshake(host: str, port: int, timeout_s: float = IO_TIMEOUT_S) -> bytes:
    """The handshake payload the P rank listening on ``host:port`` serves."""
    reply = _call(host, port, {"op": "handshake"}, timeout_s)
    payload = reply.get("payload")
    if not isinstance(payload, str):
        raise SideChannelError("handshake.payload", f"expected base64 text, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as e:
        raise SideChannelError("handshake.payload", f"not base64: {e}") from None


def send_release(host: str, port: int, request: str, d_rank: int, d_tp: int, timeout_s: float = IO_TIMEOUT_S) -> None:
    """Tell the P rank on ``host:port`` that D rank ``d_rank`` of ``d_tp`` is done with ``request``."""
    _call(host, port, {"op": "release", "request": request, "d_rank": d_rank, "d_tp": d_tp}, timeout_s)
