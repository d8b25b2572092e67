"""The reference simulator: apply a transfer plan to numpy byte buffers and check DESIGN.md 3.3.

This module is the project's oracle. It is written from the model only -- the geometry's
``attention_address`` / ``state_address``, TP ownership (``owned_slice``) and the request's block
lists -- and never from the planner::

    P memory, every rank and region               D memory, every rank and region
    +---------------------------------+           +---------------------------------+
    | coordinate hash in the computed |  copies   | stale pattern everywhere, but   |
    | tokens [p0, min(p1, M)) of the  | --------> | the coordinate hash in the      |
    | listed blocks and in the listed |           | prefix [d0, S) of listed blocks |
    | state slots; garbage elsewhere  |           +---------------------------------+
    +---------------------------------+              then rearranges, then zeros
                                                               |
    expected D = fill_decode's bytes, with the hash on needed  v
    coordinates and 0 on must-be-zero bytes  ==========  compare every D byte

Definitions (per group ``g``; ``[p0, p1)`` and ``[d0, d1)`` are the token ranges of the listed
P and D blocks, ``M`` computed tokens, ``S`` prefix-hit tokens):

* **listed pages** of a side: for every group and every region the group lives in, the kernel
  pages ``b*ppl .. b*ppl + ppl - 1`` of each listed logical block (attention) or slot (state: the
  slot's logical page). Plan-level checks allow D writes and P reads there and nowhere else.
  Padding bytes inside listed pages are allowed writes at plan level, but the content check wants
  them unchanged (``CLOBBERED``).
* **needed** (attention, D rank ``d``): tokens ``[lo, hi)``, ``lo = max(S, d0, p0)``,
  ``hi = min(M, d1, p1)``, every layer, plane, byte and every head D rank ``d`` holds.
  (state) a D slot is *paired* with the P slot that lists the same ``tokens``; every coordinate of
  D rank ``d``'s section slices of a paired slot is needed.
* **must be zero** (attention only): tokens ``[max(S, d0), d1)`` outside ``[lo, hi)``, all of D's
  heads, planes and layers (head-vector bytes only, not padding).
* everything else in D (the prefix ``[d0, S)``, padding, other blocks, unpaired state slots) must
  keep the value :func:`fill_decode` gave it.

The coordinate hash (:func:`coordinate_hash`): a 64-bit key absorbs the coordinate's fields one at
a time (``key = mix64((key ^ field) + GOLDEN)``, splitmix64's finalizer ``mix64``, a bijection);
byte ``b`` of the vector is byte ``b % 8`` (little-endian) of ``mix64(key + (b // 8 + 1) * GOLDEN)``.
Attention keys start from 0x6174746E ("attn") and absorb (group, layer, plane, global head, token);
state keys start from 0x73746174 ("stat") and absorb (group, layer, section, state tokens, global
channel, row): the token count of a state catches a slot paired with the wrong position. The P
garbage and the D stale patterns are the same byte stream, its key the salt (0x50676172 "Pgar" for
P, 0x4473746C "Dstl" for D) absorbing (0, rank, region), indexed by the byte offset in the region.

Plan-level rules beyond "listed pages": no D byte is written by two copies; no two copies (same
four ranks/regions, one's P and D ends equal to the other's P and D starts) and no two zeros could
merge; a rearrange stays inside each of its pages (else OUT_OF_BOUNDS), lists only listed pages
(else FOREIGN_WRITE and FOREIGN_READ) and has disjoint destination elements (else
OVERLAPPING_WRITE). Content violations are runs of bad bytes of one category (bad bytes fewer than
``_GAP`` bytes apart join one run, since a wrong byte equals the right one with probability 1/256).

Worked number: P engine TP1, HND, 2 local heads of 256 B, K = 16, K/V packed (the geometry
module's example). Head 1, V plane, token 5 of kernel page 0 starts at byte
``8192 + 4096 + 5 * 256 = 13568``; P's bytes [13568, 13824) hold
``coordinate_hash(g, layer, token=5, plane=1, head=1, nbytes=256)``, and a D rank holding head 1
must end with the same 256 bytes at its own address of (layer, token 5, V, head 1).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from ..arith.shard import owned_slice
from ..errors import GeometryError, InternalError, KvGeomError, PlanError, RequestError
from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, StateGroupGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import EnginePair
from ..values.plan import Copies, Rearrange, TransferPlan
from ..values.request import BlockList, Request, StateSlots

__all__ = [
    "writable_pages",
    "ViolationKind",
    "Violation",
    "Report",
    "Memory",
    "coordinate_hash",
    "attention_hash",
    "state_hash",
    "pattern_bytes",
    "listed_pages",
    "describe",
    "fill_prefill",
    "fill_decode",
    "apply_plan",
    "check_plan",
    "check_decode",
    "simulate",
]

LIST_LIMIT = 20  # violations listed per kind in a Report (counts stay exact)
_CHUNK = 1 << 22  # elements per vectorized step: bounds the int64 index arrays to 32 MiB
_BIG_ROW = 1 << 16  # copy/zero rows at least this long are applied as slices, not index arrays

# ---- the coordinate hash ---------------------------------------------------------------------

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MUL1 = _U64(0xBF58476D1CE4E5B9)
_MUL2 = _U64(0x94D049BB133111EB)
_SEED_ATTENTION = 0x61_74_74_6E  # "attn"
_SEED_STATE = 0x73_74_61_74  # "stat"
_SALT_PREFILL = 0x50_67_61_72  # "Pgar": P bytes outside computed coordinates
_SALT_DECODE = 0x44_73_74_6C  # "Dstl": D's stale bytes before the transfer


def _mix64(z: Any) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (a bijection of 64-bit integers).

    Written with ufuncs, which wrap modulo 2**64 silently (numpy scalar operators would warn).
    """
    z = np.array(z, dtype=np.uint64)  # a fresh array: the steps below work in place
    np.bitwise_xor(z, np.right_shift(z, _U64(30)), out=z)
    np.multiply(z, _MUL1, out=z)
    np.bitwise_xor(z, np.right_shift(z, _U64(27)), out=z)
    np.multiply(z, _MUL2, out=z)
    np.bitwise_xor(z, np.right_shift(z, _U64(31)), out=z)
    return z


def _absorb(key: Any, field: Any) -> np.ndarray:
    """Fold one non-negative integer field (broadcast) into a key: ``mix64((key ^ field) + GOLDEN)``."""
    f = np.asarray(field, dtype=np.int64).astype(np.uint64)
    return _mix64(np.add(np.bitwise_xor(np.asarray(key, dtype=np.uint64), f), _GOLDEN))


def _stream(key: np.ndarray, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes per key: byte b is byte b % 8 of ``mix64(key + (b // 8 + 1) * GOLDEN)``."""
    words = -(-nbytes // 8)
    steps = np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN
    z = _mix64(np.add(key[..., None], steps))
    return z.astype("<u8", copy=False).view(np.uint8)[..., :nbytes]


def attention_hash(group: int, layer: int, plane: int, token: Any, head: Any, nbytes: int) -> np.ndarray:
    """Bytes of the head vectors at (group, layer, plane, global ``head``, ``token``).

    ``token`` and ``head`` broadcast; the result has their broadcast shape plus a last axis of
    ``nbytes`` (uint8).
    """
    key = _absorb(_absorb(_absorb(_SEED_ATTENTION, group), layer), plane)
    key = _absorb(_absorb(key, head), token)
    return _stream(np.asarray(key), nbytes)


def state_hash(group: int, layer: int, section: int, state_tokens: int, channel: Any, row: Any,
               nbytes: int) -> np.ndarray:
    """Bytes of the state units at (group, layer, section, state tokens, global ``channel``, ``row``)."""
    key = _absorb(_absorb(_absorb(_absorb(_SEED_STATE, group), layer), section), state_tokens)
    key = _absorb(_absorb(key, channel), row)
    return _stream(np.asarray(key), nbytes)


def coordinate_hash(group: int, layer: int, *, nbytes: int, token: Any = None, plane: int | None = None,
                    head: Any = None, section: int | None = None, channel: Any = None, row: Any = None,
                    state_tokens: int | None = None) -> np.ndarray:
    """The bytes a global coordinate holds in the simulator (see the module docstring).

    Attention: give ``token``, ``plane`` and ``head`` (global head index). State: give ``section``
    (index in the StateSpec), ``channel`` (global), ``row`` and ``state_tokens`` (the tokens the
    state has absorbed). Returns uint8 of shape ``broadcast(...) + (nbytes,)``.
    """
    if section is None:
        if token is None or plane is None or head is None:
            raise KvGeomError("coordinate_hash", "an attention coordinate needs token, plane and head",
                              actual={"token": token, "plane": plane, "head": head},
                              fix="pass token=, plane= and head= (or section= for a state)")
        return attention_hash(group, layer, plane, token, head, nbytes)
    if channel is None or row is None or state_tokens is None:
        raise KvGeomError("coordinate_hash", "a state coordinate needs channel, row and state_tokens",
                          actual={"channel": channel, "row": row, "state_tokens": state_tokens},
                          fix="pass channel=, row= and state_tokens= with section=")
    return state_hash(group, layer, section, state_tokens, channel, row, nbytes)


def _pattern_key(salt: int, rank: int, region: int) -> np.ndarray:
    return _absorb(_absorb(_absorb(salt, 0), rank), region)


def pattern_bytes(salt: int, rank: int, region: int, offsets: Any) -> np.ndarray:
    """The background pattern (P garbage or D stale) at byte ``offsets`` of (rank, region)."""
    off = np.asarray(offsets, dtype=np.int64)
    word = np.multiply((off // 8).astype(np.uint64) + _U64(1), _GOLDEN)
    z = _mix64(np.add(_pattern_key(salt, rank, region), word)).reshape(off.shape)
    return (np.right_shift(z, (off % 8).astype(np.uint64) * _U64(8)) & _U64(0xFF)).astype(np.uint8)


def _fill_pattern(buf: np.ndarray, salt: int, rank: int, region: int) -> None:
    key = _pattern_key(salt, rank, region)
    words = -(-buf.size // 8)
    for w0 in range(0, words, _CHUNK):
        w1 = min(words, w0 + _CHUNK)
        z = _mix64(np.add(key, np.multiply(np.arange(w0 + 1, w1 + 1, dtype=np.uint64), _GOLDEN)))
        b0, b1 = w0 * 8, min(buf.size, w1 * 8)
        buf[b0:b1] = z.astype("<u8", copy=False).view(np.uint8)[: b1 - b0]


# ---- violations and the report ---------------------------------------------------------------


class ViolationKind(str, enum.Enum):
    """What is wrong; plan-level kinds first, then content kinds (checked on D bytes)."""

    OUT_OF_BOUNDS = "out_of_bounds"  # a rank, region, page or byte range outside the engine
    FOREIGN_WRITE = "foreign_write"  # a D write outside the request's listed D pages (or into held prefix pages)
    FOREIGN_READ = "foreign_read"  # a P read outside the listed P pages (or a rearrange read outside D's)
    OVERLAPPING_WRITE = "overlapping_write"  # two copies (or two rearrange elements) write one D byte
    NOT_MINIMAL = "not_minimal"  # two copies (or two zeros) could merge
    NONDETERMINISTIC = "nondeterministic"  # planning twice gave a different plan
    WRONG_DATA = "wrong_data"  # a needed or must-be-zero byte holds something else
    MISSING = "missing"  # a needed byte still holds D's stale pattern
    NOT_ZEROED = "not_zeroed"  # a must-be-zero byte still holds D's stale pattern
    CLOBBERED = "clobbered"  # a byte that must stay untouched changed

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Violation:
    """One problem: where (side, rank, region, byte offset, length), which coordinate, and why."""

    kind: ViolationKind
    side: str  # "prefill" or "decode"
    rank: int
    region: int
    offset: int
    nbytes: int
    coordinate: str = ""
    detail: str = ""

    def __str__(self) -> str:
        where = f"{self.side} rank {self.rank} region {self.region} bytes [{self.offset}, {self.offset + self.nbytes})"
        coord = f" {self.coordinate}" if self.coordinate else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.kind.value}: {where}{coord}{detail}"


@attrs.frozen
class Report:
    """The simulator's verdict. ``violations`` lists at most ``LIST_LIMIT`` per kind; ``counts``
    and ``bytes_bad`` are exact. ``bytes_checked`` is the number of D bytes compared."""

    violations: tuple[Violation, ...]
    counts: dict[ViolationKind, int]
    bytes_checked: int
    bytes_bad: dict[ViolationKind, int] = attrs.field(factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())

    def of_kind(self, kind: ViolationKind) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.kind is kind)

    def __str__(self) -> str:
        if self.ok:
            return f"OK: {self.bytes_checked} D bytes checked, no violations"
        parts = [f"{k.value} x{n} ({self.bytes_bad.get(k, 0)} B)" for k, n in self.counts.items() if n]
        lines = [f"FAILED: {', '.join(parts)}; {self.bytes_checked} D bytes checked"]
        shown: set[ViolationKind] = set()
        for v in self.violations:
            if v.kind not in shown:
                shown.add(v.kind)
                lines.append(f"  {v}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "bytes_checked": self.bytes_checked,
            "counts": {k.value: n for k, n in self.counts.items()},
            "bytes_bad": {k.value: n for k, n in self.bytes_bad.items()},
            "violations": [dict(attrs.asdict(v), kind=v.kind.value) for v in self.violations],
            "notes": list(self.notes),
        }


class _Sink:
    """Counts every violation; keeps the first ``limit`` of each kind (all when ``limit`` is None)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.items: list[Violation] = []
        self.counts: dict[ViolationKind, int] = {}
        self.bytes_bad: dict[ViolationKind, int] = {}
        self.notes: list[str] = []

    def add(self, kind: ViolationKind, count: int, nbytes: int, make: Callable[[int], Violation]) -> None:
        """Record ``count`` violations of ``kind``; ``make(i)`` builds the i-th for the listing."""
        if count <= 0:
            return
        listed = sum(1 for v in self.items if v.kind is kind)
        room = count if self.limit is None else max(0, min(count, self.limit - listed))
        self.items.extend(make(i) for i in range(room))
        self.counts[kind] = self.counts.get(kind, 0) + count
        self.bytes_bad[kind] = self.bytes_bad.get(kind, 0) + nbytes

    def one(self, violation: Violation, nbytes: int = 0) -> None:
        self.add(violation.kind, 1, nbytes, lambda _i: violation)

    def report(self, bytes_checked: int) -> Report:
        order = list(ViolationKind)
        items = sorted(self.items, key=lambda v: order.index(v.kind))
        return Report(tuple(items), {k: self.counts[k] for k in order if k in self.counts}, bytes_checked,
                      {k: self.bytes_bad[k] for k in order if k in self.bytes_bad}, tuple(self.notes))


# ---- memory ----------------------------------------------------------------------------------


@attrs.define(eq=False)
class Memory:
    """Every rank's regions of one engine as flat uint8 arrays: ``buffers[rank][region]``."""

    engine: EngineGeometry
    buffers: list[list[np.ndarray]]

    @classmethod
    def allocate(cls, engine: EngineGeometry) -> Memory:
        """Zero-filled buffers of ``num_pages * page_bytes`` for every rank and region."""
        return cls(engine, [[np.zeros(r.nbytes, np.uint8) for r in engine.regions] for _ in range(engine.tp)])

    @classmethod
    def wrap(cls, engine: EngineGeometry, buffers: Any) -> Memory:
        """Use existing uint8 arrays (e.g. ``tensor.view(torch.uint8).numpy()``) without copying.

        Each ``buffers[rank][region]`` must be a C-contiguous, writable uint8 array of exactly the
        region's ``num_pages * page_bytes`` bytes; it is kept as a flat view of the same memory.
        """
        ranks = list(buffers)
        if len(ranks) != engine.tp:
            raise GeometryError("Memory.buffers", f"{len(ranks)} ranks of buffers for an engine of tp={engine.tp}",
                                actual=len(ranks), expected=engine.tp, fix="pass one list of regions per rank")
        out: list[list[np.ndarray]] = []
        for rank, regs in enumerate(ranks):
            regs = list(regs)
            if len(regs) != len(engine.regions):
                raise GeometryError(f"Memory.buffers[{rank}]", f"{len(regs)} buffers for {len(engine.regions)} regions",
                                    actual=len(regs), expected=len(engine.regions),
                                    fix="pass one buffer per region, in the engine's region order")
            row: list[np.ndarray] = []
            for ri, (arr, region) in enumerate(zip(regs, engine.regions, strict=True)):
                path = f"Memory.buffers[{rank}][{ri}]"
                if not isinstance(arr, np.ndarray):
                    raise GeometryError(path, f"expected a numpy array, got {type(arr).__name__}",
                                        actual=type(arr).__name__, expected="numpy.ndarray of uint8",
                                        fix="pass tensor.view(torch.uint8).numpy() or a uint8 array")
                if arr.dtype != np.uint8:
                    raise GeometryError(path, f"dtype {arr.dtype} is not uint8", actual=str(arr.dtype),
                                        expected="uint8", fix="view the memory as bytes first")
                if arr.nbytes != region.nbytes:
                    raise GeometryError(path, f"{arr.nbytes} B for a region of {region.num_pages} pages x "
                                        f"{region.page_bytes} B = {region.nbytes} B", actual=arr.nbytes,
                                        expected=region.nbytes, fix="pass the region's whole allocation")
                if not arr.flags.c_contiguous or not arr.flags.writeable:
                    raise GeometryError(path, "the buffer must be C-contiguous and writable",
                                        actual={"c_contiguous": bool(arr.flags.c_contiguous),
                                                "writeable": bool(arr.flags.writeable)},
                                        expected="a contiguous writable array", fix="pass the allocation itself")
                row.append(arr.reshape(-1))
            out.append(row)
        return cls(engine, out)

    def copy(self) -> Memory:
        return Memory(self.engine, [[b.copy() for b in regs] for regs in self.buffers])

    @property
    def nbytes(self) -> int:
        return sum(b.size for regs in self.buffers for b in regs)


def _check_memory(mem: Memory, engine: EngineGeometry, side: str) -> None:
    if mem.engine.tp != engine.tp or mem.engine.regions != engine.regions:
        raise GeometryError(f"Memory({side})", f"memory was made for {mem.engine.summary()}, "
                            f"not for the pair's {side} engine {engine.summary()}",
                            actual=mem.engine.name, expected=engine.name,
                            fix=f"allocate it with Memory.allocate(pair.{side})")


# ---- walking the model -----------------------------------------------------------------------


def _page_slot(engine: EngineGeometry, listing: BlockList, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kernel page and slot of each token of a side's listed blocks (tokens inside the listing)."""
    B, K, ppl = engine.logical_block_tokens, engine.kernel_block_tokens, engine.blocks_per_logical
    rel = tokens - listing.first_token
    ids = np.asarray(listing.block_ids, dtype=np.int64)
    return ids[rel // B] * ppl + (rel % B) // K, rel % K


def _attention_vectors(engine: EngineGeometry, group: int, rank: int, listing: BlockList, lo: int,
                       hi: int) -> Iterator[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """For tokens ``[lo, hi)`` of the listed blocks, chunked: ``(layer, plane, region, starts, tokens,
    heads)``; ``starts[n, h]`` is the head vector of ``tokens[n]`` and global head ``heads[h]``."""
    spec = engine.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("callers dispatch on the spec type")
    held = owned_slice(spec.num_kv_heads, engine.tp, rank, replicated=spec.replicated)
    local = np.arange(held.size, dtype=np.int64)
    step = max(1, _CHUNK // (held.size * spec.head_bytes))
    for t0 in range(lo, hi, step):
        tokens = np.arange(t0, min(hi, t0 + step), dtype=np.int64)
        page, slot = _page_slot(engine, listing, tokens)
        for layer in range(spec.num_layers):
            for plane in range(spec.planes):
                region, starts = engine.attention_address(group, layer, plane, page[:, None], slot[:, None],
                                                          local[None, :])
                yield layer, plane, region, starts, tokens, local + held.start


def _state_units(engine: EngineGeometry, group: int, rank: int,
                 slot_id: int) -> Iterator[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray, int]]:
    """Every unit of one state slot on one rank: ``(layer, section, region, starts[c, w], channels,
    rows, unit_bytes)`` with global channel numbers."""
    spec = engine.model.groups[group]
    if not isinstance(spec, StateSpec):
        raise InternalError("callers dispatch on the spec type")
    for layer in range(spec.num_layers):
        for si, sec in enumerate(spec.sections):
            held = owned_slice(sec.channels, engine.tp, rank, replicated=sec.replicated)
            rows = np.arange(sec.rows, dtype=np.int64)
            step = max(1, _CHUNK // (sec.rows * sec.unit_bytes))
            for c0 in range(0, held.size, step):
                local = np.arange(c0, min(held.size, c0 + step), dtype=np.int64)
                region, starts = engine.state_address(group, layer, si, slot_id, local[:, None], rows[None, :])
                yield layer, si, region, starts, local + held.start, rows, sec.unit_bytes


def _vector_index(starts: np.ndarray, nbytes: int) -> np.ndarray:
    return starts[..., None] + np.arange(nbytes, dtype=np.int64)


def _listing(request: Request, group: int, side: str) -> Any:
    return getattr(request.groups[group], side)


def listed_pages(engine: EngineGeometry, request: Request, side: str) -> dict[int, np.ndarray]:
    """``{region: bool[num_pages]}``: the kernel pages the request lists on ``side``.

    Raises :class:`RequestError` when two groups list the same page of a shared region (their
    bytes would alias).
    """
    ppl = engine.blocks_per_logical
    owner: dict[int, np.ndarray] = {}
    for g in range(len(engine.model.groups)):
        listing = _listing(request, g, side)
        ids = listing.block_ids if isinstance(listing, BlockList) else listing.slot_ids
        pages = (np.asarray(ids, dtype=np.int64)[:, None] * ppl + np.arange(ppl)).ravel()
        for r in engine.group_regions(g):
            own = owner.setdefault(r, np.full(engine.regions[r].num_pages, -1, np.int64))
            prev = own[pages]
            clash = prev[(prev >= 0) & (prev != g)]
            if clash.size:
                other = engine.model.groups[int(clash[0])].name
                raise RequestError(f"Request.groups[{g}]({engine.model.groups[g].name}).{side}",
                                   f"lists pages of region {r} that group {other!r} also lists",
                                   actual=sorted(set(ids)), expected="block ids no other group uses in that region",
                                   fix="give groups that share a region distinct block ids")
            own[pages] = g
    return {r: own >= 0 for r, own in owner.items()}


def writable_pages(engine: EngineGeometry, request: Request) -> dict[int, np.ndarray]:
    """D's listed pages minus the attention pages D already holds whole (the prefix ``[0, S)``).

    ``S`` lies on a D logical-block boundary, so a listed block is either entirely before ``S``
    (held: a plan must not write it, even with identical bytes) or entirely from ``S`` on.
    """
    out = {r: m.copy() for r, m in listed_pages(engine, request, "decode").items()}
    ppl, B, S = engine.blocks_per_logical, engine.logical_block_tokens, request.prefix_hit_tokens
    for g in range(len(engine.model.groups)):
        listing = _listing(request, g, "decode")
        if not isinstance(listing, BlockList):
            continue
        held = [b for i, b in enumerate(listing.block_ids) if listing.first_token + (i + 1) * B <= S]
        if not held:
            continue
        pages = (np.asarray(held, dtype=np.int64)[:, None] * ppl + np.arange(ppl)).ravel()
        for r in engine.group_regions(g):
            out[r][pages] = False
    return out


def _check_request(pair: EnginePair, request: Request) -> None:
    pair.check_request(request)
    listed_pages(pair.prefill, request, "prefill")
    listed_pages(pair.decode, request, "decode")


def describe(engine: EngineGeometry, request: Request | None, side: str, rank: int, region: int,
             offset: int) -> str:
    """The global coordinate byte ``offset`` of ``region`` holds on ``rank``, in words.

    Found by searching the model (every view of every group that uses the region), so it is slow
    and used only for listed violations. A byte of a page the request does not list is described
    by page and slot; a byte no view covers is padding.
    """
    if not 0 <= region < len(engine.regions):
        return f"(region {region} does not exist)"
    reg = engine.regions[region]
    if not 0 <= offset < reg.nbytes:
        return f"(byte {offset} is outside region {region}'s {reg.nbytes} B)"
    ppl = engine.blocks_per_logical
    found: list[tuple[bool, str]] = []
    for g, spec in enumerate(engine.model.groups):
        if region not in engine.group_regions(g):
            continue
        listing = _listing(request, g, side) if request is not None else None
        geo = engine.groups[g]
        if isinstance(spec, AttentionSpec) and isinstance(geo, AttentionGroupGeometry):
            page, within = divmod(offset, reg.page_bytes)
            block, sub = divmod(page, ppl)
            held = owned_slice(spec.num_kv_heads, engine.tp, rank, replicated=spec.replicated)
            heads = np.arange(held.size)[:, None]
            slots = np.arange(engine.kernel_block_tokens)[None, :]
            for layer, view in enumerate(geo.views):
                for plane, preg in enumerate(view.regions):
                    if preg != region:
                        continue
                    _, starts = engine.attention_address(g, layer, plane, 0, slots, heads)
                    rel = within - starts
                    hit = np.argwhere((rel >= 0) & (rel < spec.head_bytes))
                    if not hit.size:
                        continue
                    h, s = (int(x) for x in hit[0])
                    pname = "latent" if spec.planes == 1 else "KV"[plane]
                    listed = isinstance(listing, BlockList) and block in listing.block_ids
                    if listed:
                        if not isinstance(listing, BlockList):
                            raise InternalError("narrowed for mypy")
                        token = (listing.first_token + listing.block_ids.index(block) * engine.logical_block_tokens
                                 + sub * engine.kernel_block_tokens + s)
                        where = f"token {token}"
                    else:
                        where = f"slot {s} of page {page} (block {block} not listed)"
                    found.append((listed, f"{spec.name} layer {layer} {pname} {where} head {held.start + h} "
                                          f"byte {int(rel[h, s])}"))
        elif isinstance(spec, StateSpec) and isinstance(geo, StateGroupGeometry):
            slot_id, within = divmod(offset, engine.logical_page_bytes(region))
            listed = isinstance(listing, StateSlots) and slot_id in listing.slot_ids
            if listed:
                if not isinstance(listing, StateSlots):
                    raise InternalError("narrowed for mypy")
                tag = f"slot {slot_id}, {listing.tokens[listing.slot_ids.index(slot_id)]} tokens"
            else:
                tag = f"slot {slot_id} not listed"
            for layer, sview in enumerate(geo.views):
                if sview.region != region:
                    continue
                for si, sec in enumerate(spec.sections):
                    held = owned_slice(sec.channels, engine.tp, rank, replicated=sec.replicated)
                    ch = np.arange(held.size)[:, None]
                    rows = np.arange(sec.rows)[None, :]
                    _, starts = engine.state_address(g, layer, si, 0, ch, rows)
                    rel = within - starts
                    hit = np.argwhere((rel >= 0) & (rel < sec.unit_bytes))
                    if hit.size:
                        c, w = (int(x) for x in hit[0])
                        found.append((listed, f"{spec.name} layer {layer} section {sec.name!r} channel "
                                              f"{held.start + c} row {w} byte {int(rel[c, w])} ({tag})"))
    if not found:
        page, within = divmod(offset, reg.page_bytes)
        return f"padding: page {page} byte {within} (no coordinate lives here)"
    found.sort(key=lambda f: not f[0])  # listed blocks first
    return found[0][1]


# ---- filling ---------------------------------------------------------------------------------


def _fill_background(mem: Memory, engine: EngineGeometry, side: str, salt: int) -> None:
    """Check ``mem`` fits ``engine``, then fill every byte with the side's salted pattern."""
    _check_memory(mem, engine, side)
    for rank, regs in enumerate(mem.buffers):
        for ri, buf in enumerate(regs):
            _fill_pattern(buf, salt, rank, ri)


def fill_prefill(pair: EnginePair, request: Request, mem: Memory) -> None:
    """P memory: the garbage pattern everywhere, then the coordinate hash in computed tokens
    ``[p0, min(p1, M))`` of every listed block and in every listed state slot (with its tokens)."""
    engine = pair.prefill
    _fill_background(mem, engine, "prefill", _SALT_PREFILL)
    M = request.computed_tokens
    for g, spec in enumerate(engine.model.groups):
        listing = _listing(request, g, "prefill")
        for rank in range(engine.tp):
            if isinstance(spec, AttentionSpec):
                p0, p1 = listing.token_range(engine.logical_block_tokens)
                for layer, plane, region, starts, tokens, heads in _attention_vectors(engine, g, rank, listing,
                                                                                      p0, min(p1, M)):
                    mem.buffers[rank][region][_vector_index(starts, spec.head_bytes)] = attention_hash(
                        g, layer, plane, tokens[:, None], heads[None, :], spec.head_bytes)
            else:
                for slot_id, t in zip(listing.slot_ids, listing.tokens, strict=True):
                    for layer, si, region, starts, chans, rows, unit in _state_units(engine, g, rank, slot_id):
                        mem.buffers[rank][region][_vector_index(starts, unit)] = state_hash(
                            g, layer, si, t, chans[:, None], rows[None, :], unit)


def fill_decode(pair: EnginePair, request: Request, mem: Memory) -> None:
    """D memory before the transfer: the stale pattern everywhere, except the prefix tokens
    ``[d0, min(S, d1))`` of listed D blocks, which D already holds (the coordinate hash)."""
    engine = pair.decode
    _fill_background(mem, engine, "decode", _SALT_DECODE)
    S = request.prefix_hit_tokens
    for g, spec in enumerate(engine.model.groups):
        if not isinstance(spec, AttentionSpec):
            continue
        listing = _listing(request, g, "decode")
        d0, d1 = listing.token_range(engine.logical_block_tokens)
        for rank in range(engine.tp):
            for layer, plane, region, starts, tokens, heads in _attention_vectors(engine, g, rank, listing,
                                                                                  d0, min(S, d1)):
                mem.buffers[rank][region][_vector_index(starts, spec.head_bytes)] = attention_hash(
                    g, layer, plane, tokens[:, None], heads[None, :], spec.head_bytes)


# ---- applying a plan -------------------------------------------------------------------------


def _ranges(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(o, o + n)`` for every row."""
    total = int(lengths.sum())
    before = np.cumsum(lengths) - lengths
    return np.repeat(offsets - before, lengths) + np.arange(total, dtype=np.int64)


def _row_chunks(lengths: np.ndarray) -> Iterator[slice]:
    """Consecutive row slices of about ``_CHUNK`` bytes each (at least one row)."""
    cum = np.cumsum(lengths)
    i, n = 0, len(lengths)
    while i < n:
        base = int(cum[i - 1]) if i else 0
        j = max(i + 1, int(np.searchsorted(cum, base + _CHUNK, side="right")))
        yield slice(i, j)
        i = j


def _move(src: np.ndarray | None, dst: np.ndarray, src_off: np.ndarray, dst_off: np.ndarray,
          lengths: np.ndarray) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every row, in row order (``src`` None: write zeros)."""
    big = lengths >= _BIG_ROW
    for i in np.flatnonzero(big):
        s, d, n = int(src_off[i]), int(dst_off[i]), int(lengths[i])
        dst[d:d + n] = 0 if src is None else src[s:s + n]
    small = np.flatnonzero(~big)
    so, do, ln = src_off[small], dst_off[small], lengths[small]
    for part in _row_chunks(ln):
        idx = _ranges(do[part], ln[part])
        dst[idx] = 0 if src is None else src[_ranges(so[part], ln[part])]


def _element_offsets(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> np.ndarray:
    """Byte offset (inside a page) of every element of a rearrange, first axis outermost."""
    off = np.array([offset], dtype=np.int64)
    for n, s in zip(shape, strides, strict=True):
        off = (off[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return off


def _apply_rearrange(buf: np.ndarray, r: Rearrange) -> None:
    """Read every element of every listed page, then write them all (the documented order)."""
    src = _element_offsets(r.shape, r.src_strides, r.src_offset)
    dst = _element_offsets(r.shape, r.dst_strides, r.dst_offset)
    pages = np.asarray(r.pages, dtype=np.int64) * r.page_bytes
    unit = np.arange(r.unit_bytes, dtype=np.int64)
    step = max(1, _CHUNK // max(1, src.size * r.unit_bytes))
    values = [buf[(pages[i:i + step, None, None] + src[None, :, None] + unit).ravel()]
              for i in range(0, len(pages), step)]
    for k, i in enumerate(range(0, len(pages), step)):
        buf[(pages[i:i + step, None, None] + dst[None, :, None] + unit).ravel()] = values[k]


def apply_plan(plan: TransferPlan, pmem: Memory, dmem: Memory) -> None:
    """Apply copies, then rearranges, then zeros to ``dmem`` (P memory is only read).

    Raises :class:`PlanError` when a row leaves the engines' ranks, regions or pages; run
    :func:`check_plan` first (or :func:`simulate`, which skips such rows) to get them as violations.
    """
    sink = _Sink(1)
    copy_bad, zero_bad, rearr_bad = _out_of_bounds(pmem.engine, dmem.engine, plan, sink, check_tp=False)
    if copy_bad.any() or zero_bad.any() or rearr_bad.any():
        first = sink.items[0]
        raise PlanError("TransferPlan", f"{sum(sink.counts.values())} rows out of bounds; first: {first}",
                        actual=str(first), expected="rows inside both engines' regions",
                        fix="run kvgeom.checking.check_plan to list them")
    c = plan.copies
    if len(c):
        keys = np.stack([c.p_rank, c.p_region, c.d_rank, c.d_region], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for k, (pr, preg, dr, dreg) in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv == k)
            _move(pmem.buffers[pr][preg], dmem.buffers[dr][dreg], c.p_offset[rows], c.d_offset[rows],
                  c.nbytes[rows])
    for r in plan.rearranges:
        _apply_rearrange(dmem.buffers[r.d_rank][r.d_region], r)
    z = plan.zeros
    if len(z):
        keys = np.stack([z.d_rank, z.d_region], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for k, (dr, dreg) in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv == k)
            _move(None, dmem.buffers[dr][dreg], z.d_offset[rows], z.d_offset[rows], z.nbytes[rows])


# ---- plan-level checks -----------------------------------------------------------------------


def _range_bad(tp: int, engine: EngineGeometry, rank: np.ndarray, region: np.ndarray, offset: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray:
    """Rows whose rank, region or byte range [offset, offset + nbytes) is outside the engine."""
    sizes = np.array([r.nbytes for r in engine.regions], dtype=np.int64)
    region_ok = region < len(sizes)
    limit = np.where(region_ok, sizes[np.minimum(region, len(sizes) - 1)], 0)
    return (rank >= tp) | ~region_ok | (offset + nbytes > limit)


def _rearrange_problem(engine: EngineGeometry, r: Rearrange) -> str:
    """Why a rearrange leaves its engine or its pages (empty when it does not)."""
    if not 0 <= r.d_rank < engine.tp:
        return f"d_rank {r.d_rank} outside tp={engine.tp}"
    if not 0 <= r.d_region < len(engine.regions):
        return f"d_region {r.d_region} does not exist ({len(engine.regions)} regions)"
    reg = engine.regions[r.d_region]
    if r.page_bytes != reg.page_bytes:
        return f"page_bytes {r.page_bytes} != region {r.d_region}'s {reg.page_bytes}"
    bad_pages = [p for p in r.pages if not 0 <= p < reg.num_pages]
    if bad_pages:
        return f"page {bad_pages[0]} outside the region's {reg.num_pages} pages"
    if r.unit_bytes <= 0 or any(n <= 0 for n in r.shape):
        return f"empty element (unit_bytes {r.unit_bytes}, shape {r.shape})"
    for name, offs in (("source", _element_offsets(r.shape, r.src_strides, r.src_offset)),
                       ("destination", _element_offsets(r.shape, r.dst_strides, r.dst_offset))):
        lo, hi = int(offs.min()), int(offs.max()) + r.unit_bytes
        if lo < 0 or hi > reg.page_bytes:
            return f"{name} elements span page bytes [{lo}, {hi}), outside [0, {reg.page_bytes})"
    return ""


def _out_of_bounds(P: EngineGeometry, D: EngineGeometry, plan: TransferPlan, sink: _Sink, *,
                   check_tp: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OUT_OF_BOUNDS rows: masks over copies, zeros and rearranges (rows to skip when applying)."""
    oob = ViolationKind.OUT_OF_BOUNDS
    for side, have, want in (("prefill", plan.prefill_tp, P.tp), ("decode", plan.decode_tp, D.tp)):
        if check_tp and have != want:
            sink.one(Violation(oob, side, have, -1, 0, 0, "", f"the plan is for {side} tp={have}, the engine has tp={want}"))
    c = plan.copies
    p_bad = _range_bad(P.tp, P, c.p_rank, c.p_region, c.p_offset, c.nbytes)
    d_bad = _range_bad(D.tp, D, c.d_rank, c.d_region, c.d_offset, c.nbytes)
    for side, bad, rk, rg, off in (("prefill", p_bad, c.p_rank, c.p_region, c.p_offset),
                                   ("decode", d_bad, c.d_rank, c.d_region, c.d_offset)):
        rows = np.flatnonzero(bad)

        def make(i: int, rows: np.ndarray = rows, side: str = side, rk: np.ndarray = rk, rg: np.ndarray = rg,
                 off: np.ndarray = off) -> Violation:
            row = int(rows[i])
            return Violation(oob, side, int(rk[row]), int(rg[row]), int(off[row]), int(c.nbytes[row]), "",
                             f"copy row {row} leaves the {side} engine")

        sink.add(oob, len(rows), int(c.nbytes[rows].sum()), make)
    z = plan.zeros
    z_bad = _range_bad(D.tp, D, z.d_rank, z.d_region, z.d_offset, z.nbytes)
    zrows = np.flatnonzero(z_bad)
    sink.add(oob, len(zrows), int(z.nbytes[zrows].sum()), lambda i: Violation(
        oob, "decode", int(z.d_rank[zrows[i]]), int(z.d_region[zrows[i]]), int(z.d_offset[zrows[i]]),
        int(z.nbytes[zrows[i]]), "", f"zero row {int(zrows[i])} leaves the decode engine"))
    r_bad = np.zeros(len(plan.rearranges), dtype=bool)
    for k, r in enumerate(plan.rearranges):
        why = _rearrange_problem(D, r)
        if why:
            r_bad[k] = True
            sink.one(Violation(oob, "decode", r.d_rank, r.d_region, 0, 0, "", f"rearrange {k}: {why}"))
    return p_bad | d_bad, z_bad, r_bad


def _outside_pages(mask: np.ndarray | None, page_bytes: int, offset: np.ndarray,
                   nbytes: np.ndarray) -> np.ndarray:
    """Rows whose byte range touches a page not set in ``mask`` (None: no page is allowed)."""
    if mask is None:
        return np.ones(len(offset), dtype=bool)
    foreign_before = np.concatenate(([0], np.cumsum(~mask)))
    first = offset // page_bytes
    last = (offset + nbytes - 1) // page_bytes
    return foreign_before[last + 1] - foreign_before[first] > 0


def _first_outside(mask: np.ndarray | None, page_bytes: int, offset: int, nbytes: int) -> int:
    first, last = offset // page_bytes, (offset + nbytes - 1) // page_bytes
    if mask is None:
        return offset
    page = first + int(np.flatnonzero(~mask[first:last + 1])[0])
    return max(offset, page * page_bytes)


def _confined(sink: _Sink, kind: ViolationKind, side: str, engine: EngineGeometry, request: Request,
              allowed: dict[int, np.ndarray], what: str, keep: np.ndarray, rank: np.ndarray,
              region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> None:
    """Report rows (among ``keep``) whose bytes leave the listed pages of their region."""
    for reg in np.unique(region[keep]).tolist():
        rows = np.flatnonzero(keep & (region == reg))
        mask = allowed.get(reg)
        pb = engine.regions[reg].page_bytes
        bad = rows[_outside_pages(mask, pb, offset[rows], nbytes[rows])]

        def make(i: int, bad: np.ndarray = bad, mask: np.ndarray | None = mask, pb: int = pb,
                 reg: int = reg) -> Violation:
            row = int(bad[i])
            at = _first_outside(mask, pb, int(offset[row]), int(nbytes[row]))
            return Violation(kind, side, int(rank[row]), reg, int(offset[row]), int(nbytes[row]),
                             describe(engine, request, side, int(rank[row]), reg, at),
                             f"{what} row {row} touches byte {at} (page {at // pb}), not a page this request lists")

        sink.add(kind, len(bad), int(nbytes[bad].sum()), make)


def _overlapping_copies(sink: _Sink, D: EngineGeometry, request: Request, c: Copies, keep: np.ndarray) -> None:
    rows = np.flatnonzero(keep)
    if len(rows) < 2:
        return
    order = rows[np.lexsort((c.d_offset[rows], c.d_region[rows], c.d_rank[rows]))]
    group = c.d_rank[order] * (len(D.regions) + 1) + c.d_region[order]
    span = max(r.nbytes for r in D.regions) + 1
    _, gid = np.unique(group, return_inverse=True)
    gid = gid.reshape(-1).astype(np.int64)
    # running maximum of the ends seen so far within each (rank, region): a start below it overlaps
    ends = np.maximum.accumulate(gid * span + c.d_offset[order] + c.nbytes[order]) - gid * span
    same = np.concatenate(([False], gid[1:] == gid[:-1]))
    prev_end = np.concatenate(([0], ends[:-1]))
    hit = order[same & (c.d_offset[order] < prev_end)]

    def make(i: int) -> Violation:
        row = int(hit[i])
        dr, dreg, do, dn = int(c.d_rank[row]), int(c.d_region[row]), int(c.d_offset[row]), int(c.nbytes[row])
        others = np.flatnonzero(keep & (c.d_rank == dr) & (c.d_region == dreg) & (c.d_offset < do + dn)
                                & (c.d_offset + c.nbytes > do) & (np.arange(len(c)) != row))
        return Violation(ViolationKind.OVERLAPPING_WRITE, "decode", dr, dreg, do, dn,
                         describe(D, request, "decode", dr, dreg, do),
                         f"copy row {row} writes bytes copy row(s) {others[:4].tolist()} also write")

    sink.add(ViolationKind.OVERLAPPING_WRITE, len(hit), int(c.nbytes[hit].sum()), make)


def _mergeable(sink: _Sink, side_cols: np.ndarray, starts: np.ndarray, ends: np.ndarray, what: str,
               make_where: Callable[[int], tuple[int, int, int]], lengths: np.ndarray, rows: np.ndarray) -> None:
    """Rows whose end tuple equals another row's start tuple (same ranks and regions)."""
    if len(rows) < 2:
        return
    s_id, e_id = _tuple_ids(np.concatenate([side_cols, starts], axis=1), np.concatenate([side_cols, ends], axis=1))
    hit = np.flatnonzero(np.isin(e_id, s_id))

    def make(i: int) -> Violation:
        k = int(hit[i])
        j = int(np.flatnonzero(s_id == e_id[k])[0])
        rank, region, offset = make_where(int(rows[k]))
        return Violation(ViolationKind.NOT_MINIMAL, "decode", rank, region, offset, int(lengths[rows[k]]), "",
                         f"{what} row {int(rows[k])} ends where {what} row {int(rows[j])} starts: they could merge")

    sink.add(ViolationKind.NOT_MINIMAL, len(hit), 0, make)


def _tuple_ids(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer ids such that two rows (of ``a`` or ``b``) get the same id exactly when they are
    equal tuples. Packs the columns into one int64 when their ranges fit (fast path), else falls
    back to ``np.unique(axis=0)``."""
    both = np.concatenate([a, b])
    lo, hi = both.min(axis=0), both.max(axis=0)
    widths = [int(x) for x in (hi - lo + 1)]
    span = 1
    for w in widths:
        span *= w
    if span < 1 << 62:
        key = np.zeros(len(both), np.int64)
        for col, w in enumerate(widths):
            key = key * w + (both[:, col] - lo[col])
        return key[: len(a)], key[len(a):]
    _, inv = np.unique(both, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    return inv[: len(a)], inv[len(a):]


def _determinism(sink: _Sink, plan: TransferPlan, replan: TransferPlan) -> None:
    kind = ViolationKind.NONDETERMINISTIC
    diffs: list[str] = []
    if (plan.prefill_tp, plan.decode_tp) != (replan.prefill_tp, replan.decode_tp):
        diffs.append(f"tp ({plan.prefill_tp}, {plan.decode_tp}) then ({replan.prefill_tp}, {replan.decode_tp})")
    for name in ("copies", "zeros"):
        a, b = getattr(plan, name).as_array(), getattr(replan, name).as_array()
        if a.shape != b.shape:
            diffs.append(f"{name}: {len(a)} rows then {len(b)} rows")
        else:
            rows = np.flatnonzero((a != b).any(axis=1))
            if rows.size:
                diffs.append(f"{name}: {rows.size} rows differ, first row {int(rows[0])}: "
                             f"{a[rows[0]].tolist()} then {b[rows[0]].tolist()}")
    if plan.rearranges != replan.rearranges:
        diffs.append(f"rearranges differ ({len(plan.rearranges)} then {len(replan.rearranges)})")
    sink.add(kind, len(diffs), 0, lambda i: Violation(kind, "decode", -1, -1, 0, 0, "",
                                                     f"planning twice gave different plans: {diffs[i]}"))


def _plan_checks(pair: EnginePair, request: Request, plan: TransferPlan, replan: TransferPlan | None,
                 sink: _Sink) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    P, D = pair.prefill, pair.decode
    copy_bad, zero_bad, rearr_bad = _out_of_bounds(P, D, plan, sink)
    p_allowed = listed_pages(P, request, "prefill")
    d_allowed = writable_pages(D, request)
    c, z = plan.copies, plan.zeros
    ck, zk = ~copy_bad, ~zero_bad
    _confined(sink, ViolationKind.FOREIGN_WRITE, "decode", D, request, d_allowed, "copy", ck,
              c.d_rank, c.d_region, c.d_offset, c.nbytes)
    _confined(sink, ViolationKind.FOREIGN_WRITE, "decode", D, request, d_allowed, "zero", zk,
              z.d_rank, z.d_region, z.d_offset, z.nbytes)
    _confined(sink, ViolationKind.FOREIGN_READ, "prefill", P, request, p_allowed, "copy", ck,
              c.p_rank, c.p_region, c.p_offset, c.nbytes)
    for k, r in enumerate(plan.rearranges):
        if rearr_bad[k]:
            continue
        mask = d_allowed.get(r.d_region)
        foreign = [p for p in r.pages if mask is None or not mask[p]]
        for kind in (ViolationKind.FOREIGN_WRITE, ViolationKind.FOREIGN_READ):  # it reads and writes its pages

            def make(i: int, r: Rearrange = r, k: int = k, foreign: list[int] = foreign,
                     kind: ViolationKind = kind) -> Violation:
                at = foreign[i] * r.page_bytes
                return Violation(kind, "decode", r.d_rank, r.d_region, at, r.page_bytes,
                                 describe(D, request, "decode", r.d_rank, r.d_region, at),
                                 f"rearrange {k} permutes page {foreign[i]}, not a page this request lists")

            sink.add(kind, len(foreign), len(foreign) * r.page_bytes, make)
        dst = np.sort(_element_offsets(r.shape, r.dst_strides, r.dst_offset))
        if dst.size > 1 and np.any(np.diff(dst) < r.unit_bytes):
            at = int(dst[int(np.argmax(np.diff(dst) < r.unit_bytes))])
            sink.one(Violation(ViolationKind.OVERLAPPING_WRITE, "decode", r.d_rank, r.d_region, at, r.unit_bytes, "",
                               f"rearrange {k}: two elements land on page byte {at} (destination elements overlap)"))
    _overlapping_copies(sink, D, request, c, ck)
    rows = np.flatnonzero(ck)
    cc = np.stack([c.p_rank, c.p_region, c.d_rank, c.d_region], axis=1)[rows]
    _mergeable(sink, cc, np.stack([c.p_offset, c.d_offset], axis=1)[rows],
               np.stack([c.p_offset + c.nbytes, c.d_offset + c.nbytes], axis=1)[rows], "copy",
               lambda row: (int(c.d_rank[row]), int(c.d_region[row]), int(c.d_offset[row])), c.nbytes, rows)
    zrows = np.flatnonzero(zk)
    zc = np.stack([z.d_rank, z.d_region], axis=1)[zrows]
    _mergeable(sink, zc, z.d_offset[zrows, None], (z.d_offset + z.nbytes)[zrows, None], "zero",
               lambda row: (int(z.d_rank[row]), int(z.d_region[row]), int(z.d_offset[row])), z.nbytes, zrows)
    if replan is not None:
        _determinism(sink, plan, replan)
    return copy_bad, zero_bad, rearr_bad


def check_plan(pair: EnginePair, request: Request, plan: TransferPlan, *, replan: TransferPlan | None = None,
               max_per_kind: int | None = None) -> list[Violation]:
    """Plan-level invariants, on the rows alone: OUT_OF_BOUNDS, FOREIGN_WRITE, FOREIGN_READ,
    OVERLAPPING_WRITE, NOT_MINIMAL and (with ``replan``) NONDETERMINISTIC.

    Every violation is returned unless ``max_per_kind`` caps the listing per kind.
    """
    _check_request(pair, request)
    sink = _Sink(max_per_kind)
    _plan_checks(pair, request, plan, replan, sink)
    return sink.items


# ---- content checks --------------------------------------------------------------------------

_KEEP, _NEEDED, _ZERO = 0, 1, 2
_GAP = 4  # bad bytes at most this far apart form one run


def _expected_decode(pair: EnginePair, request: Request) -> tuple[Memory, list[list[np.ndarray]]]:
    """D's bytes after a correct transfer, and each byte's category (keep, needed, must be zero)."""
    P, D = pair.prefill, pair.decode
    exp = Memory.allocate(D)
    fill_decode(pair, request, exp)
    cat = [[np.zeros(b.size, np.uint8) for b in regs] for regs in exp.buffers]
    M, S = request.computed_tokens, request.prefix_hit_tokens
    for g, spec in enumerate(D.model.groups):
        pl, dl = _listing(request, g, "prefill"), _listing(request, g, "decode")
        for rank in range(D.tp):
            if isinstance(spec, AttentionSpec):
                p0, p1 = pl.token_range(P.logical_block_tokens)
                d0, d1 = dl.token_range(D.logical_block_tokens)
                start = max(S, d0)
                lo, hi = max(start, p0), min(M, d1, p1)
                spans = [(lo, hi, _NEEDED)] if lo < hi else []
                spans += [(start, min(lo, d1), _ZERO), (max(hi, start), d1, _ZERO)] if lo < hi else [(start, d1, _ZERO)]
                for a, b, what in spans:
                    for layer, plane, region, starts, tokens, heads in _attention_vectors(D, g, rank, dl, a, b):
                        idx = _vector_index(starts, spec.head_bytes)
                        cat[rank][region][idx] = what
                        exp.buffers[rank][region][idx] = 0 if what == _ZERO else attention_hash(
                            g, layer, plane, tokens[:, None], heads[None, :], spec.head_bytes)
            else:
                p_tokens = set(pl.tokens)
                for slot_id, t in zip(dl.slot_ids, dl.tokens, strict=True):
                    if t not in p_tokens:
                        continue  # unpaired: D keeps whatever it had
                    for layer, si, region, starts, chans, rows, unit in _state_units(D, g, rank, slot_id):
                        idx = _vector_index(starts, unit)
                        cat[rank][region][idx] = _NEEDED
                        exp.buffers[rank][region][idx] = state_hash(g, layer, si, t, chans[:, None], rows[None, :],
                                                                    unit)
    return exp, cat


def _content_checks(pair: EnginePair, request: Request, dmem: Memory, sink: _Sink) -> int:
    D = pair.decode
    _check_memory(dmem, D, "decode")
    exp, cat = _expected_decode(pair, request)
    checked = 0
    for rank in range(D.tp):
        for region in range(len(D.regions)):
            got, want = dmem.buffers[rank][region], exp.buffers[rank][region]
            checked += got.size
            at = np.flatnonzero(got != want)
            if not at.size:
                continue
            category = cat[rank][region][at]
            stale = got[at] == pattern_bytes(_SALT_DECODE, rank, region, at)
            # runs: bad bytes of one category less than _GAP apart (a wrong byte equals the expected one
            # by chance with probability 1/256; bridging such holes keeps one run per damaged range)
            new = np.concatenate(([True], (np.diff(at) > _GAP) | (category[1:] != category[:-1])))
            first = np.flatnonzero(new)
            last = np.append(first[1:], at.size) - 1
            span = at[last] - at[first] + 1
            bad = last - first + 1
            all_stale = np.minimum.reduceat(stale.astype(np.uint8), first).astype(bool)
            run_cat = category[first]
            codes = np.where(run_cat == _KEEP, 0, np.where(all_stale, np.where(run_cat == _NEEDED, 1, 2), 3))
            for code, kind in enumerate((ViolationKind.CLOBBERED, ViolationKind.MISSING, ViolationKind.NOT_ZEROED,
                                         ViolationKind.WRONG_DATA)):
                runs = np.flatnonzero(codes == code)

                def make(i: int, runs: np.ndarray = runs, kind: ViolationKind = kind, rank: int = rank,
                         region: int = region, got: np.ndarray = got, want: np.ndarray = want,
                         at: np.ndarray = at, first: np.ndarray = first, span: np.ndarray = span) -> Violation:
                    r = int(runs[i])
                    off, n = int(at[first[r]]), int(span[r])
                    show = min(n, 8)
                    more = "..." if n > show else ""
                    return Violation(kind, "decode", rank, region, off, n,
                                     describe(D, request, "decode", rank, region, off),
                                     f"expected {want[off:off + show].tobytes().hex()}{more} "
                                     f"got {got[off:off + show].tobytes().hex()}{more}")

                sink.add(kind, len(runs), int(bad[runs].sum()), make)
    return checked


def check_decode(pair: EnginePair, request: Request, dmem: Memory, *,
                 max_per_kind: int | None = None) -> tuple[list[Violation], int]:
    """Content invariants on D memory after a plan ran on :func:`fill_prefill` /
    :func:`fill_decode` memory. Every D byte is compared with the expected bytes; a difference is
    reported per run of consecutive bytes of one category:

    * needed bytes: MISSING when every byte of the run still holds the stale pattern, else WRONG_DATA;
    * must-be-zero bytes: NOT_ZEROED when the run is all stale, else WRONG_DATA;
    * every other byte: CLOBBERED.

    Returns the violations and the number of D bytes compared.
    """
    _check_request(pair, request)
    sink = _Sink(max_per_kind)
    checked = _content_checks(pair, request, dmem, sink)
    return sink.items, checked


# ---- the whole run ---------------------------------------------------------------------------


def simulate(pair: EnginePair, request: Request, plan: TransferPlan, *, replan: TransferPlan | None = None) -> Report:
    """Check ``plan`` against every invariant of DESIGN.md 3.3 and return a :class:`Report`.

    Allocates both engines' memory, fills it, runs the plan-level checks, applies the plan
    (without OUT_OF_BOUNDS rows, which are reported instead) and compares every D byte.
    """
    _check_request(pair, request)
    sink = _Sink(LIST_LIMIT)
    copy_bad, zero_bad, rearr_bad = _plan_checks(pair, request, plan, replan, sink)
    skipped = int(copy_bad.sum() + zero_bad.sum() + rearr_bad.sum())
    if skipped:
        sink.notes.append(f"{skipped} out-of-bounds rows were not applied")
        kept: tuple[Rearrange, ...] = tuple(r for k, r in enumerate(plan.rearranges) if not rearr_bad[k])
        plan = attrs.evolve(plan, prefill_tp=max(plan.prefill_tp, pair.prefill.tp),
                            decode_tp=max(plan.decode_tp, pair.decode.tp),
                            copies=plan.copies.take(~copy_bad), zeros=plan.zeros.take(~zero_bad),
                            rearranges=kept)  # type: ignore[arg-type]  # plan.py: converter=tuple is untyped
    pmem, dmem = Memory.allocate(pair.prefill), Memory.allocate(pair.decode)
    fill_prefill(pair, request, pmem)
    fill_decode(pair, request, dmem)
    apply_plan(plan, pmem, dmem)
    checked = _content_checks(pair, request, dmem, sink)
    return sink.report(checked)
