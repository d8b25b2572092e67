"""The handshake payload: what one rank tells a peer engine about itself, as versioned JSON.

    {"kvgeom_handshake": 3,                     <- payload version (3: the eager pull's "read" message)
     "role": "prefill", "rank": 1, "agent": "kvgeom-prefill-1-3f2a",
     "engine": {... kvgeom.tools.serialize document of the engine's geometry ...},
     "memory": {"mem_type": "DRAM",
                "regions": [{"addr": 139..., "nbytes": 1048576, "device": 0}, ...]},
     "nixl_metadata": "<base64 of nixl_agent.get_agent_metadata()>",
     "secret": "<base64 of the endpoint's 32 random bytes>",   <- keys the link's messages (§8.1)
     "staging": {"addr": ..., "nbytes": 2097152, "device": 0, "slot_bytes": 1048576, "slots": 2}}
                                                  <- only from an endpoint with a staging buffer

The secret makes the payload a credential: whoever holds both sides' payloads can sign messages
between them, so the payloads must travel over an authenticated, confidential channel
(docs/design.md §8.1). No pickle: the NIXL metadata travels as base64 and everything else is plain JSON. Decoding checks
everything before the payload is used: its size and nesting (bounded JSON, :func:`kvgeom.tools.parse_json`),
the version, every field's type, the geometry (through :mod:`kvgeom.tools.serialize`), the configured
maxima of a remote's sizes (:class:`HandshakeLimits`: TP, ranks, regions, pages per region),
one memory entry per region of the geometry and each exactly ``num_pages * page_bytes`` bytes
(with pipeline stages: one per region of the rank's stage, docs/design.md §11.4), addresses that
do not wrap around. ``rank`` is the flat rank ``0 <= rank < num_ranks`` (docs/design.md §11.1).
Any failure raises :class:`HandshakeError` naming the field; a peer that advertises regions not
fitting its own geometry is refused before any transfer (docs/design.md §6, §8 and §14: peer
input is hostile).

Worked number: a TP1 engine with one region of 64 pages x 16384 B must advertise exactly one
region of ``64 * 16384 = 1048576`` bytes; advertising 1048575 fails with
``$.memory.regions[0].nbytes: 1048575 B advertised for a region of 64 x 16384 = 1048576 B``.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import attrs
import numpy as np

from kvgeom import EngineGeometry, InternalError, SchemaError, value_text
from kvgeom.lowering import rank_region_bytes
from kvgeom.tools import from_dict, parse_json, to_dict
from kvgeom.values import check_int, is_int

from .errors import HandshakeError
from .memory import MEM_TYPES
from .protocol import SECRET_BYTES

__all__ = ["HANDSHAKE_VERSION", "RankInfo", "encode_rank", "decode_rank", "ROLES", "HandshakeLimits",
           "DEFAULT_LIMITS"]

HANDSHAKE_VERSION = 3  # 3: a D rank may send "read" (an eager pull), which a version-2 peer drops
ROLES = ("prefill", "decode")
_KEYS = {"kvgeom_handshake", "role", "rank", "agent", "engine", "memory", "nixl_metadata", "secret"}
_OPTIONAL = {"staging"}
_STAGING_KEYS = {"addr", "nbytes", "device", "slot_bytes", "slots"}
MAX_SLOTS = 1 << 10  # a ring of more slots than this is refused (a peer's input is hostile)


@attrs.frozen
class HandshakeLimits:
    """The largest sizes a peer may advertise (configured maxima, docs/design.md §14).

    ``max_bytes``: the payload (an 80-layer engine's is about 30 KiB); ``max_tp``: the peer's TP
    size, and so the payloads one ``connect`` may be given; ``max_ranks``: all its ranks
    (``pp * replicas * tp``); ``max_regions``: its regions; ``max_pages``: the pages of one of its
    regions. A payload beyond any of them is refused before (or, for the ranks, as soon as) its
    geometry is built (:class:`HandshakeError`).
    """

    max_bytes: int = 1 << 20
    max_tp: int = 1024
    max_ranks: int = 1 << 14
    max_regions: int = 4096
    max_pages: int = 1 << 32

    def __attrs_post_init__(self) -> None:
        for name in ("max_bytes", "max_tp", "max_ranks", "max_regions", "max_pages"):
            check_int(f"HandshakeLimits.{name}", getattr(self, name), minimum=1, error=HandshakeError)


DEFAULT_LIMITS = HandshakeLimits()


@attrs.frozen
class RankInfo:
    """A validated handshake: one rank of an engine, its memory and its NIXL agent."""

    engine: EngineGeometry
    role: str
    rank: int
    agent: str
    mem_type: str
    regions: tuple[tuple[int, int, int], ...]  # (addr, nbytes, device) per region
    metadata: bytes = attrs.field(repr=False)
    staging: tuple[int, int, int, int, int] | None = None  # (addr, nbytes, device, slot_bytes, slots)
    secret: bytes = attrs.field(default=b"", repr=False)  # keys the messages of every link to this rank

    @property
    def region_ids(self) -> tuple[int, ...]:
        """The geometry's regions this rank holds (its pipeline stage's, docs/design.md §11.4)."""
        return self.engine.rank_regions(self.rank)

    def _by_region(self, column: int) -> np.ndarray:
        out = np.zeros(len(self.engine.regions), np.uint64)
        out[list(self.region_ids)] = [r[column] for r in self.regions]
        return out

    @property
    def bases(self) -> np.ndarray:
        """Base address per region of the geometry (0 for regions this rank does not hold)."""
        return self._by_region(0)

    @property
    def devices(self) -> np.ndarray:
        return self._by_region(2)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Bytes per region of the geometry on this rank (0 for regions this rank does not hold)."""
        return rank_region_bytes(self.engine, self.rank)


def encode_rank(info: RankInfo) -> bytes:
    """The payload bytes for :func:`decode_rank` on the peer."""
    doc = {
        "kvgeom_handshake": HANDSHAKE_VERSION,
        "role": info.role,
        "rank": info.rank,
        "agent": info.agent,
        "engine": to_dict(info.engine),
        "memory": {"mem_type": info.mem_type,
                   "regions": [{"addr": a, "nbytes": n, "device": d} for a, n, d in info.regions]},
        "nixl_metadata": base64.b64encode(info.metadata).decode("ascii"),
        "secret": base64.b64encode(info.secret).decode("ascii"),
    }
    if info.staging is not None:
        addr, nbytes, device, slot_bytes, slots = info.staging
        doc["staging"] = {"addr": addr, "nbytes": nbytes, "device": device, "slot_bytes": slot_bytes, "slots": slots}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _fail(path: str, message: str, **kw: Any) -> HandshakeError:
    return HandshakeError(path, message, **kw)


def _int(path: str, v: Any, lo: int, hi: int | None = None) -> int:
    if not is_int(v):
        raise _fail(path, f"expected an integer, got {type(v).__name__} {value_text(v, 60)}", actual=value_text(v, 60),
                    expected="integer")
    if v < lo or (hi is not None and v >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise _fail(path, f"{value_text(int(v))} is out of range", actual=int(v), expected=rng)
    return int(v)


def _str(path: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(path, f"expected a non-empty string, got {type(v).__name__}", actual=value_text(v, 60),
                    expected="string")
    return v


def _within(path: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise _fail(path, f"the peer advertises {value_text(value)} {what}, beyond the configured maximum of {limit}",
                    actual=value, expected=f"<= {limit}",
                    fix="a real engine does not have that many; raise HandshakeLimits only if it really does")


def decode_rank(payload: bytes | bytearray | str, *, limits: HandshakeLimits = DEFAULT_LIMITS) -> RankInfo:
    """Validate a peer's payload; raises :class:`HandshakeError` naming the first bad field."""
    if not isinstance(payload, (bytes, bytearray, str)):
        raise _fail("$", f"expected bytes, got {type(payload).__name__}", actual=type(payload).__name__,
                    expected="bytes")
    doc = parse_json(payload, max_bytes=limits.max_bytes, error=HandshakeError, what="payload")
    if not isinstance(doc, dict):
        raise _fail("$", f"expected a JSON object, got {type(doc).__name__}", expected="object")
    if "kvgeom_handshake" not in doc:
        raise _fail("$.kvgeom_handshake", "missing payload version (not a kvgeom handshake?)",
                    expected=HANDSHAKE_VERSION)
    ver = doc["kvgeom_handshake"]
    if not is_int(ver) or ver != HANDSHAKE_VERSION:
        raise _fail("$.kvgeom_handshake", f"unsupported handshake version {value_text(ver, 60)}", actual=ver,
                    expected=HANDSHAKE_VERSION, fix="run the same kvgeom_nixl version on both engines")
    missing = sorted(_KEYS - set(doc))
    if missing:
        raise _fail(f"$.{missing[0]}", "missing field", expected=sorted(_KEYS), fix=f'send "{missing[0]}"')
    extra = sorted(set(doc) - _KEYS - _OPTIONAL)
    if extra:
        raise _fail(f"$.{extra[0]}", "unknown field", actual=extra, expected=sorted(_KEYS))
    role = _str("$.role", doc["role"])
    if role not in ROLES:
        raise _fail("$.role", f"unknown role {value_text(role, 60)}", actual=role, expected=list(ROLES))
    agent = _str("$.agent", doc["agent"])
    _peek_sizes(doc["engine"], limits)
    try:
        engine = from_dict(doc["engine"], expect=EngineGeometry)
    except (HandshakeError, InternalError):
        raise
    except SchemaError as e:
        raise _fail("$.engine" + e.path[1:], e.message, actual=e.actual, expected=e.expected, fix=e.fix) from e
    _within("$.engine.tp", engine.tp, limits.max_tp, "ranks (tp)")
    _within("$.engine.topology", engine.num_ranks, limits.max_ranks, "ranks (pp x replicas x tp)")
    rank = _int("$.rank", doc["rank"], 0, engine.num_ranks)
    held = engine.rank_regions(rank)
    mem = doc["memory"]
    if not isinstance(mem, dict) or set(mem) != {"mem_type", "regions"}:
        raise _fail("$.memory", "expected {mem_type, regions}", actual=sorted(mem) if isinstance(mem, dict) else mem,
                    expected=["mem_type", "regions"])
    mem_type = mem["mem_type"]
    if mem_type not in MEM_TYPES:
        raise _fail("$.memory.mem_type", f"unknown memory type {value_text(mem_type, 60)}", actual=mem_type, expected=list(MEM_TYPES))
    regs = mem["regions"]
    if not isinstance(regs, list):
        raise _fail("$.memory.regions", "expected an array", actual=type(regs).__name__, expected="array")
    if len(regs) != len(held):
        whose = f"a geometry with {len(engine.regions)}" if len(held) == len(engine.regions) else \
            f"rank {rank}, whose pipeline stage holds {len(held)} of the geometry's {len(engine.regions)}"
        raise _fail("$.memory.regions", f"{len(regs)} regions advertised for {whose}",
                    actual=len(regs), expected=len(held),
                    fix="register one allocation per region of the geometry the rank holds")
    regions: list[tuple[int, int, int]] = []
    for i, (r, geo) in enumerate(zip(regs, [engine.regions[h] for h in held], strict=True)):
        p = f"$.memory.regions[{i}]"
        if not isinstance(r, dict) or set(r) != {"addr", "nbytes", "device"}:
            raise _fail(p, "expected {addr, nbytes, device}", actual=r, expected=["addr", "device", "nbytes"])
        addr = _int(f"{p}.addr", r["addr"], 1, 1 << 64)
        nbytes = _int(f"{p}.nbytes", r["nbytes"], 1)
        device = _int(f"{p}.device", r["device"], 0, 1 << 31)
        if nbytes != geo.nbytes:
            raise _fail(f"{p}.nbytes", f"{nbytes} B advertised for a region of {geo.num_pages} x {geo.page_bytes} = "
                        f"{geo.nbytes} B", actual=nbytes, expected=geo.nbytes,
                        fix="the peer's memory does not match its geometry; fix the peer's configuration")
        if addr + nbytes > 1 << 64:
            raise _fail(f"{p}.addr", "region wraps past the end of the address space", actual=addr)
        regions.append((addr, nbytes, device))
    md = doc["nixl_metadata"]
    if not isinstance(md, str) or not md:
        raise _fail("$.nixl_metadata", "expected base64 text", actual=type(md).__name__, expected="string")
    try:
        metadata = base64.b64decode(md.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise _fail("$.nixl_metadata", f"not valid base64: {e}", fix="send the payload unmodified") from e
    staging = _staging(doc["staging"]) if "staging" in doc else None
    return RankInfo(engine, role, rank, agent, mem_type, tuple(regions), metadata, staging, _secret(doc["secret"]))


def _secret(v: Any) -> bytes:
    """The peer's secret: base64 of exactly SECRET_BYTES bytes."""
    if not isinstance(v, str) or len(v) > 64:
        raise _fail("$.secret", "expected base64 text of 32 bytes", actual=value_text(v, 60), expected="string")
    try:
        raw = base64.b64decode(v.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise _fail("$.secret", f"not valid base64: {e}", fix="send the payload unmodified") from e
    if len(raw) != SECRET_BYTES:
        raise _fail("$.secret", f"a secret of {len(raw)} bytes", actual=len(raw), expected=SECRET_BYTES,
                    fix="send the payload handshake() made, unmodified")
    return raw


def _peek_sizes(engine_doc: Any, limits: HandshakeLimits) -> None:
    """The configured maxima, read from the document before its geometry is built (a remote's ``tp``,
    its region count and each region's pages)."""
    if not isinstance(engine_doc, dict):
        return  # from_dict refuses it with the path
    tp: Any = engine_doc.get("tp")
    if is_int(tp):
        _within("$.engine.tp", int(tp), limits.max_tp, "ranks (tp)")
    regions = engine_doc.get("regions")
    if isinstance(regions, list):
        _within("$.engine.regions", len(regions), limits.max_regions, "regions")
        for i, r in enumerate(regions):
            pages: Any = r.get("num_pages") if isinstance(r, dict) else None
            if is_int(pages):
                _within(f"$.engine.regions[{i}].num_pages", int(pages), limits.max_pages, "pages in one region")


def _staging(st: Any) -> tuple[int, int, int, int, int]:
    """A peer's staging buffer: (addr, nbytes, device, slot_bytes, slots), checked."""
    if not isinstance(st, dict) or set(st) != _STAGING_KEYS:
        raise _fail("$.staging", f"expected {{{', '.join(sorted(_STAGING_KEYS))}}}",
                    actual=sorted(st) if isinstance(st, dict) else st, expected=sorted(_STAGING_KEYS))
    addr = _int("$.staging.addr", st["addr"], 1, 1 << 64)
    nbytes = _int("$.staging.nbytes", st["nbytes"], 1, 1 << 48)
    device = _int("$.staging.device", st["device"], 0, 1 << 31)
    slot_bytes = _int("$.staging.slot_bytes", st["slot_bytes"], 1, 1 << 48)
    slots = _int("$.staging.slots", st["slots"], 2, MAX_SLOTS + 1)
    if slot_bytes * slots != nbytes:
        raise _fail("$.staging.nbytes", f"{nbytes} B advertised for {slots} slots of {slot_bytes} B",
                    actual=nbytes, expected=slot_bytes * slots, fix="advertise the whole ring")
    if addr + nbytes > 1 << 64:
        raise _fail("$.staging.addr", "the staging buffer wraps past the end of the address space", actual=addr)
    return addr, nbytes, device, slot_bytes, slots
