"""The connector's side channel: a small TCP listener per P worker rank (docs/design.md §15.3).

Three requests cross it, each one length-prefixed JSON frame each way:

* ``{"op": "handshake", "engine": <D engine id>, "rank": d, "tp": n, "payload": <base64>}`` ->
  ``{"payload": <base64>}``: D worker rank ``d`` of ``n`` hands over its decode endpoint's
  :meth:`~kvgeom_nixl.Endpoint.handshake` payload and gets this P rank's prefill payload back.
  The answer comes only once this P rank has connected to all ``n`` D ranks of that engine (its
  link, whose keys authenticate D's ``req``), so D may pull as soon as it has every P rank's payload.
* ``{"op": "release", "request": <P's request id>, "d_rank": r, "d_tp": n}`` -> ``{"ok": true}``:
  a D rank is done with a request (its pull ended, or none was needed); P frees the request's
  blocks once all ``n`` D ranks said so (or its lease expires).
* ``{"op": "packed", "engine", "d_rank", "d_tp", "agent", "request", "document", "staging_bytes",
  "digest", "mac"}`` -> ``{"ok": true}``: before a packed pull, a D rank hands each P rank it reads
  from the request it planned (a kvgeom request document, both block tables), the staging capacity
  the plan was cut for and the plan's digest, signed with their link's key (:class:`PackedOffer`).
  P answers once it planned the same plan (its digest equal), so that it packs what D unpacks;
  an offer it refuses is answered ``{"error": ...}`` and D's pull fails before anything is posted.

Everything read from the socket is hostile (docs/design.md §14): frames beyond ``MAX_FRAME``
bytes, non-JSON, wrong types, ids beyond 512 characters and unbounded tables are refused with
:class:`SideChannelError` naming the field; the connection is answered ``{"error": ...}`` and
dropped, the listener keeps serving. The payloads are credentials (docs/design.md §8.1): this
channel is plain TCP, so it belongs on a private network or loopback, as vLLM's own side channel.

Threading: one daemon thread accepts; each connection is served on its own daemon thread (at most
``MAX_CONNECTIONS`` at once, more are refused), because a handshake waits for the other D ranks.
The server's own state is its lock-protected release table; a handshake calls the connector's
``on_handshake`` callback, which takes the executor's lock itself.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvgeom_nixl.errors import ExecutorError

__all__ = ["MAX_FRAME", "MAX_PENDING", "MAX_CONNECTIONS", "MAX_DOCUMENT", "SideChannelError", "SideChannelServer",
           "PackedOffer", "exchange_handshake", "send_release", "send_packed", "read_frame", "write_frame"]

MAX_FRAME = 16 << 20  # a handshake payload of a large engine is ~100 KB; 16 MiB bounds a hostile one
MAX_PENDING = 100_000  # release entries kept for requests P has not yet been told about
MAX_CONNECTIONS = 64  # connections served at once
MAX_ID = 512  # characters of a request or engine id
PENDING_TTL_S = 3600.0
IO_TIMEOUT_S = 120.0  # generous: on a loaded host a worker thread can stall for seconds
_LEN = struct.Struct("!I")

MAX_DOCUMENT = 8 << 20  # characters of a packed offer's request document (about 500k block ids in all;
# a request beyond it is refused: D's pull fails before posting and vLLM recomputes)
MAX_REQUEST_ID = 256  # characters of a request id in the NIXL protocol (kvgeom_nixl.protocol.MAX_ID)
OnHandshake = Callable[[str, int, int, bytes], None]
"""``(D engine id, D rank, D tp, D payload)``: returns once this P rank is linked to that D engine."""


@dataclass(frozen=True)
class PackedOffer:
    """D rank ``d_rank`` of engine ``engine`` (NIXL agent ``agent``) will pull P's ``request`` with a
    packed plan: ``document`` is the kvgeom request it planned (``kvgeom.tools.dumps``),
    ``staging_bytes`` the capacity the plan was cut for, ``digest`` the plan's
    (:func:`kvgeom_nixl.vllm.packed_pulls.plan_digest`), ``mac`` :meth:`signed_bytes` signed with the
    link's key (``Link.sign_document``)."""

    engine: str
    d_rank: int
    d_tp: int
    agent: str
    request: str
    document: str
    staging_bytes: int
    digest: str
    mac: str = ""

    def signed_bytes(self) -> bytes:
        """What the MAC covers: every field P acts on (the engine, ranks and agent name the link)."""
        return f"{self.engine}|{self.d_rank}|{self.d_tp}|{self.staging_bytes}|{self.digest}|{self.document}".encode()


OnPacked = Callable[[PackedOffer], None]
"""Returns once this P rank planned the offer's plan and will serve it; raises to refuse it."""


class SideChannelError(ExecutorError):
    """A side-channel peer sent something this end refuses, or could not be reached."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise SideChannelError("frame", f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> dict[str, Any]:
    """One frame: a 4-byte big-endian length (at most ``MAX_FRAME``), then a JSON object."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise SideChannelError("frame.length", f"a {n}-byte frame is beyond the limit", actual=n,
                               expected=f"<= {MAX_FRAME}")
    try:
        msg = json.loads(_recv_exact(sock, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise SideChannelError("frame", f"not JSON: {e}") from None
    except RecursionError:
        raise SideChannelError("frame", "JSON nested too deeply") from None
    if not isinstance(msg, dict):
        raise SideChannelError("frame", f"a frame is a JSON object, got {type(msg).__name__}")
    return msg


def write_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _int_field(msg: dict[str, Any], op: str, name: str, lo: int, hi: int) -> int:
    v = msg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SideChannelError(f"{op}.{name}", f"expected an integer in [{lo}, {hi}], got {v!r:.60}",
                               actual=repr(v)[:60], expected=f"{lo} <= {name} <= {hi}")
    return v


def _str_field(msg: dict[str, Any], op: str, name: str) -> str:
    v = msg.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID:
        raise SideChannelError(f"{op}.{name}", f"expected a string of 1-{MAX_ID} characters, got {v!r:.60}",
                               actual=repr(v)[:60], expected=f"1-{MAX_ID} characters")
    return v


def _packed_offer(msg: dict[str, Any]) -> PackedOffer:
    """A ``packed`` frame's fields, each checked for type and bounds (the MAC is P's to check)."""
    d_tp = _int_field(msg, "packed", "d_tp", 1, 4096)
    doc = msg.get("document")
    if not isinstance(doc, str) or not 0 < len(doc) <= MAX_DOCUMENT:
        raise SideChannelError("packed.document", f"expected a request document of 1-{MAX_DOCUMENT} characters",
                               actual=f"{type(doc).__name__} of {len(doc) if isinstance(doc, str) else '?'}",
                               expected=f"1-{MAX_DOCUMENT} characters")
    digest, mac = msg.get("digest"), msg.get("mac")
    for name, v, n in (("digest", digest, 64), ("mac", mac, 32)):
        if not isinstance(v, str) or len(v) != n or any(c not in "0123456789abcdef" for c in v):
            raise SideChannelError(f"packed.{name}", f"expected {n} lowercase hex digits, got {v!r:.60}",
                                   actual=repr(v)[:60], expected=f"{n} hex digits")
    request = _str_field(msg, "packed", "request")
    if len(request) > MAX_REQUEST_ID or "|" in request:
        raise SideChannelError("packed.request", f"a request id of at most {MAX_REQUEST_ID} characters without "
                               f"'|' (the NIXL protocol's), got {request!r:.60}", actual=request[:60],
                               expected=f"<= {MAX_REQUEST_ID} characters, no '|'")
    return PackedOffer(_str_field(msg, "packed", "engine"), _int_field(msg, "packed", "d_rank", 0, d_tp - 1), d_tp,
                       _str_field(msg, "packed", "agent"), request, doc,
                       _int_field(msg, "packed", "staging_bytes", 1, 1 << 40), str(digest), str(mac))


def _b64(value: Any, path: str) -> bytes:
    if not isinstance(value, str):
        raise SideChannelError(path, f"expected base64 text, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as e:
        raise SideChannelError(path, f"not base64: {e}") from None


class SideChannelServer:
    """One P worker rank's listener: exchanges handshake payloads, collects D's releases and hands
    D's packed offers on.

    ``on_handshake`` and ``on_packed`` (None: a server that refuses handshakes or offers, for tests
    of the release table) are called on the connection's thread; what they raise is answered as an
    error."""

    def __init__(self, host: str, port: int, payload: bytes, on_handshake: OnHandshake | None = None,
                 on_packed: OnPacked | None = None) -> None:
        self._payload = base64.b64encode(payload).decode()
        self._on_handshake = on_handshake
        self._on_packed = on_packed
        self._lock = threading.Lock()
        self._released: dict[str, tuple[float, int, set[int]]] = {}  # request -> (first seen, d_tp, d ranks)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise SideChannelError("KVGEOM_SIDE_CHANNEL_PORT", f"cannot listen on {host}:{port}: {e}", actual=port,
                                   fix="give each engine its own port (TP rank r listens on port + r), "
                                   "outside the ephemeral range") from None
        self._sock.settimeout(0.5)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"kvgeom-side-channel-{port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, f"more than {MAX_CONNECTIONS} connections at once")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvgeom-side-channel-conn", daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket, why: str) -> None:
        with conn:
            try:
                conn.settimeout(1.0)
                write_frame(conn, {"error": why})
            except OSError:
                pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    write_frame(conn, self._answer(read_frame(conn)))
                except (ExecutorError, OSError) as e:  # a hostile or broken peer: tell it, drop it, keep serving
                    try:
                        write_frame(conn, {"error": str(e)[:500]})
                    except OSError:
                        pass
        finally:
            self._slots.release()

    def _answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "handshake":
            engine = _str_field(msg, "handshake", "engine")
            tp = _int_field(msg, "handshake", "tp", 1, 4096)
            rank = _int_field(msg, "handshake", "rank", 0, tp - 1)
            payload = _b64(msg.get("payload"), "handshake.payload")
            if self._on_handshake is None:
                raise SideChannelError("handshake", "this listener takes no handshakes (no prefill endpoint)")
            self._on_handshake(engine, rank, tp, payload)
            return {"payload": self._payload}
        if op == "release":
            req = _str_field(msg, "release", "request")
            d_tp = _int_field(msg, "release", "d_tp", 1, 4096)
            d_rank = _int_field(msg, "release", "d_rank", 0, d_tp - 1)
            with self._lock:
                self._prune()
                if req not in self._released and len(self._released) >= MAX_PENDING:
                    raise SideChannelError("release", f"{MAX_PENDING} releases pending, refusing more")
                _, tp, ranks = self._released.setdefault(req, (time.monotonic(), d_tp, set()))
                if tp != d_tp:
                    raise SideChannelError("release.d_tp", f"request {req!r:.60} was released with d_tp {tp}",
                                           actual=d_tp, expected=tp)
                ranks.add(d_rank)
            return {"ok": True}
        if op == "packed":
            if self._on_packed is None:
                raise SideChannelError("packed", "this listener serves no packed pulls (no prefill endpoint)")
            self._on_packed(_packed_offer(msg))
            return {"ok": True}
        raise SideChannelError("op", f"unknown op {op!r:.60}", actual=repr(op)[:60],
                               expected=["handshake", "release", "packed"])

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

    def released_ranks(self, request: str) -> frozenset[int]:
        """The D ranks that released ``request`` so far (kept until all have: :meth:`released`)."""
        with self._lock:
            entry = self._released.get(request)
            return frozenset(entry[2]) if entry is not None else frozenset()

    def forget(self, request: str) -> None:
        with self._lock:
            self._released.pop(request, None)

    def forget_if(self, done: Callable[[str], bool]) -> int:
        """Forget the release entries of every request ``done(request)`` says P has already freed
        (a D rank that released after P's lease or a failed hold freed it); returns how many."""
        with self._lock:
            gone = [r for r in self._released if done(r)]
            for r in gone:
                del self._released[r]
        return len(gone)

    def pending(self) -> int:
        """Release entries kept (requests some but not all D ranks released, or P never had)."""
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


def exchange_handshake(host: str, port: int, engine: str, rank: int, tp: int, payload: bytes,
                       timeout_s: float = IO_TIMEOUT_S) -> bytes:
    """Give the P rank on ``host:port`` this D rank's payload; return that P rank's payload (once
    it has connected to every D rank of ``engine``)."""
    reply = _call(host, port, {"op": "handshake", "engine": engine, "rank": rank, "tp": tp,
                               "payload": base64.b64encode(payload).decode()}, timeout_s)
    return _b64(reply.get("payload"), "handshake.payload")


def send_release(host: str, port: int, request: str, d_rank: int, d_tp: int, timeout_s: float = IO_TIMEOUT_S) -> None:
    """Tell the P rank on ``host:port`` that D rank ``d_rank`` of ``d_tp`` is done with ``request``."""
    _call(host, port, {"op": "release", "request": request, "d_rank": d_rank, "d_tp": d_tp}, timeout_s)


def send_packed(host: str, port: int, offer: PackedOffer, timeout_s: float = IO_TIMEOUT_S) -> None:
    """Hand the P rank on ``host:port`` a packed pull's offer; returns once P planned the same plan
    (:class:`SideChannelError` when it refused, with P's reason)."""
    _call(host, port, {"op": "packed", **asdict(offer)}, timeout_s)
