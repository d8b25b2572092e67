"""The notifications of the transfer protocol: attempts, nonces and authenticated messages (docs/design.md §8.1).

Every message one rank sends another names the attempt it belongs to and is signed with the key of
the link between the two agents::

    kvgeom2|<kind>|<D nonce>|<P nonce>|<args...>|<request id>|<mac>
      kind      one of KINDS (req, grant, pulled, read, held, pushed, acked, cancel, ended, ping, and the
                packed plans' want, slot, packed, chunk_pulled, landed)
      nonces    16 hex digits each, drawn fresh for every attempt (pull, push, serve_pull, hold,
                accept_push); 0 where the sender does not know the peer's yet (a D rank's first ``req``)
      args      integers below 2**32 (chunk, slot, consumers)
      mac       the first 16 bytes (32 hex digits) of HMAC-SHA256(link key, sender | receiver | body)

The link key is HMAC-SHA256 over the two agents' names keyed with both endpoints' secrets (32 random
bytes each, sent in the handshake): a process that holds one side's handshake cannot sign messages
between the two (it lacks the other secret); one that holds both handshakes can (the handshakes must
travel over an authenticated, confidential channel, §8.1). A message longer than ``MAX_MESSAGE``
bytes, malformed, of an unknown kind, with a bad MAC or from an agent that is not a connected peer is
dropped before anything of it is stored.

Worked number: the message ``kvgeom2|req|00000000000000a1|0000000000000000|2|r1|<32 hex>`` is D's
attempt 0xa1 asking P for request ``r1``, saying 2 D ranks read from that P rank; it is 84 bytes.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

import attrs

from .errors import ExecutorError

__all__ = ["KINDS", "MAX_MESSAGE", "MAX_ID", "Message", "encode", "decode", "link_key", "new_nonce",
           "new_secret", "forget_keys", "SECRET_BYTES", "document_mac", "document_signed"]

TAG = "kvgeom2"
KINDS = {
    "req": 1,  # D -> P: D's attempt opens; args: how many D ranks read from this P rank (0: unknown)
    "grant": 0,  # P -> D: P's attempt holds its blocks for D's attempt (direct pull)
    "pulled": 0,  # D -> P: NIXL's notification of D's READ (after the data)
    "read": 1,  # D -> P: an eager READ's notification (after the data; no req before it); args: as req's
    "held": 0,  # P -> D: P still held its blocks when the READ finished (a direct pull is done)
    "pushed": 0,  # P -> D: NIXL's notification of P's WRITE (after the data)
    "acked": 0,  # D -> P: D's attempt is done (a push, a serve_pull or a hold ends done on it)
    "cancel": 0,  # either: the sender's attempt is over (failed); the receiver fails its own
    "ended": 0,  # either: nothing of the sender's attempt touches the receiver's memory any more
    "ping": 0,  # either: liveness (a dead peer makes NIXL refuse the send)
    "want": 1,  # P -> D (packed push): chunk; P asks for a D slot, in P's order
    "slot": 2,  # D -> P (packed push): chunk, D slot granted for it
    "packed": 2,  # P -> D (packed pull): chunk, P slot holding it
    "chunk_pulled": 1,  # D -> P (packed pull): NIXL's notification of the READ of a chunk
    "landed": 1,  # P -> D (packed push): NIXL's notification of the WRITE of a chunk
}
"""Message kinds and how many integer arguments each carries."""

MAX_ID = 256  # characters of a request id (the endpoint refuses longer ones; a peer's are dropped)
MAX_MESSAGE = 512  # bytes of one message: anything longer is dropped unread
SECRET_BYTES = 32
_MAC_HEX = 32
_MAX_ARG = 1 << 32
_NONCE_HEX = 16


@attrs.frozen
class Message:
    """One verified message: who sent it, its kind, the two attempts' nonces, its args and request id."""

    sender: str
    kind: str
    d_nonce: int
    p_nonce: int
    args: tuple[int, ...]
    request_id: str


def new_secret() -> bytes:
    """An endpoint's secret for its handshake (32 random bytes)."""
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> int:
    """A fresh attempt nonce: 64 random bits, never 0."""
    return secrets.randbits(64) or 1


def link_key(prefill_secret: bytes, decode_secret: bytes, prefill_agent: str, decode_agent: str) -> bytes:
    """The key both ends of one (P agent, D agent) link compute from the two handshakes."""
    body = f"kvgeom-link|{prefill_agent}|{decode_agent}".encode()
    return hmac.new(prefill_secret + decode_secret, body, hashlib.sha256).digest()


@functools.lru_cache(maxsize=256)
def _mac_prefix(key: bytes, sender: str, receiver: str) -> hmac.HMAC:
    """The HMAC of ``sender|receiver|`` under ``key``, kept per (key, sender, receiver), 256 at
    most in the process (a message's MAC copies it and adds the body: the key's pads are not hashed
    again for every message); :func:`forget_keys` drops them all."""
    return hmac.new(key, sender.encode() + b"|" + receiver.encode() + b"|", hashlib.sha256)


def forget_keys() -> None:
    """Drop every kept HMAC state (an endpoint calls this when it forgets a link's key, so that no
    state derived from a dropped key outlives it; the others are rebuilt on their next message)."""
    _mac_prefix.cache_clear()


def _mac(key: bytes, sender: str, receiver: str, body: bytes) -> str:
    """HMAC-SHA256 of ``sender|receiver|body`` under ``key``, truncated to ``_MAC_HEX`` hex digits."""
    mac = _mac_prefix(key, sender, receiver).copy()  # (copy: the cached object is never updated)
    mac.update(body)
    return mac.hexdigest()[:_MAC_HEX]


def encode(key: bytes, sender: str, receiver: str, kind: str, request_id: str, d_nonce: int, p_nonce: int,
           *args: int) -> bytes:
    """The signed message of ``kind`` (:data:`KINDS`) from ``sender`` to ``receiver``."""
    if KINDS.get(kind) != len(args):
        raise ExecutorError("notification", f"kind {kind!r} takes {KINDS.get(kind)} arguments, got {len(args)}",
                            actual=(kind, args), expected=KINDS)
    body = "|".join([TAG, kind, f"{d_nonce:016x}", f"{p_nonce:016x}", *(str(int(a)) for a in args), request_id])
    raw = body.encode()
    return raw + b"|" + _mac(key, sender, receiver, raw).encode()


def decode(raw: bytes, sender: str, receiver: str, key: bytes) -> Message | None:
    """The message in ``raw`` if it is well formed and signed with ``key``, else None (hostile input)."""
    if len(raw) > MAX_MESSAGE:
        return None
    body, sep, mac = raw.rpartition(b"|")
    if not sep or len(mac) != _MAC_HEX:
        return None
    try:
        if not hmac.compare_digest(_mac(key, sender, receiver, body), mac.decode("ascii")):
            return None
        tag, kind, dn, pn, rest = body.decode("utf-8").split("|", 4)
    except (UnicodeDecodeError, ValueError):
        return None
    n = KINDS.get(kind)
    if tag != TAG or n is None or len(dn) != _NONCE_HEX or len(pn) != _NONCE_HEX:
        return None
    parts = rest.split("|", n)
    if len(parts) != n + 1 or not parts[n] or len(parts[n]) > MAX_ID:
        return None
    try:
        d_nonce, p_nonce = int(dn, 16), int(pn, 16)
    except ValueError:
        return None
    args = []
    for a in parts[:n]:
        if not (a.isdigit() and len(a) <= 10 and int(a) < _MAX_ARG):
            return None
        args.append(int(a))
    return Message(sender, kind, d_nonce, p_nonce, tuple(args), parts[n])


_DOC_TAG = b"kvgeom2-document"


def document_mac(key: bytes, sender: str, receiver: str, request_id: str, document_sha256: bytes) -> str:
    """The MAC of a document ``sender`` hands ``receiver`` about ``request_id`` outside NIXL (the
    connector's side channel), given the document's SHA-256 (hashed by the caller, so that a
    receiver hashes a peer's document before it takes any lock): HMAC-SHA256 of
    ``sender|receiver|kvgeom2-document|<request id>|<sha256 hex>`` under the link key, 32 hex
    digits. Its tag keeps it apart from every notification (those start ``kvgeom2|``), so neither
    can be replayed as the other."""
    body = b"|".join([_DOC_TAG, request_id.encode(), document_sha256.hex().encode()])
    return _mac(key, sender, receiver, body)


def document_signed(key: bytes, sender: str, receiver: str, request_id: str, document_sha256: bytes,
                    mac: str) -> bool:
    """Whether ``mac`` is :func:`document_mac` of the document (constant-time compare; a missing key never is)."""
    if not key or not isinstance(mac, str) or len(mac) != _MAC_HEX:
        return False
    return hmac.compare_digest(document_mac(key, sender, receiver, request_id, document_sha256), mac)
