"""The parts of a packed plan: pack and unpack steps, wire rows, chunks (docs/design.md §12).

A packed plan moves bytes in three passes per chunk, then zeros::

    P cache --pack steps--> P staging slot --wire rows--> D staging slot --unpack steps--> D cache
             (StagingStep, side "prefill")  (WireCopies)                  (StagingStep, side "decode")

A :class:`StagingStep` is structural, like a :class:`~kvgeom.values.plan.Rearrange`: one strided
pattern applied to every (layer entry, page entry) pair. Element ``e`` (a multi-index over
``shape``, first mode outermost) of layer entry ``l`` and page entry ``k`` sits at::

    cache byte    region regions[l], offset pages[k] * page_bytes + offsets[l] + sum(e * cache_strides)
    staging byte  slot of chunk ``chunk``, offset staged[l] + page_staged[k] + sum(e * staging_strides)

:meth:`StagingStep.cache_offsets` and :meth:`StagingStep.staging_offsets` are that definition,
used alike by the simulator, the drawing and :mod:`kvgeom.lowering.staging` (the executor's
strided views and index rows). A step's size grows with layer entries plus page entries, never
with the number of byte runs.

Worked number: a D page of 2 heads x 8 tokens x 256 B, K and V packed (8192 B), unpacked whole
from a dense block: ``shape=(1,)``, ``unit_bytes=8192``, one element per page; 10 such pages and
4 layers are a step of 4 layer entries and 10 page entries moving ``4 * 10 * 8192 = 327,680 B``.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..arith.runs import element_offsets
from ..errors import PlanError
from .fields import check_int, int_tuple

__all__ = ["StagingStep", "WireCopies", "WIRE_COLUMNS", "ChunkPiece", "Chunk", "STAGING_SIDES"]

STAGING_SIDES = ("prefill", "decode")  # a step on P (pack) or on D (unpack)
WIRE_COLUMNS = ("chunk", "p_rank", "p_offset", "d_rank", "d_offset", "nbytes")


def _array(name: str, value: Any) -> np.ndarray:
    """A read-only contiguous int64 vector of values >= 0 (a :class:`PlanError` naming ``name`` otherwise)."""
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.reshape(0)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise PlanError(name, f"must be a vector of integers, got shape {arr.shape} dtype {arr.dtype}",
                        actual=str(arr.dtype), expected="int64 vector", fix="pass integer arrays")
    out = np.ascontiguousarray(arr, dtype=np.int64).view()
    out.setflags(write=False)
    if out.size and int(out.min()) < 0:
        i = int(np.argmax(out < 0))
        raise PlanError(f"{name}[{i}]", f"must be >= 0, got {int(out[i])}", actual=int(out[i]), expected=">= 0")
    return out


@attrs.frozen(eq=False, repr=False)
class StagingStep:
    """One pack step (``side="prefill"``: P cache -> P staging, on ``p_rank``) or unpack step
    (``side="decode"``: D staging -> D cache, on ``d_rank``) of ``chunk``, for the bytes P rank
    ``p_rank`` sends D rank ``d_rank``; see the module docstring for every element's two addresses.

    ``page_bytes`` is the unit of ``pages`` (a kernel page; a logical page for state groups).
    """

    side: str
    chunk: int
    p_rank: int
    d_rank: int
    regions: np.ndarray = attrs.field(converter=lambda v: _array("StagingStep.regions", v))
    offsets: np.ndarray = attrs.field(converter=lambda v: _array("StagingStep.offsets", v))
    staged: np.ndarray = attrs.field(converter=lambda v: _array("StagingStep.staged", v))
    pages: np.ndarray = attrs.field(converter=lambda v: _array("StagingStep.pages", v))
    page_staged: np.ndarray = attrs.field(converter=lambda v: _array("StagingStep.page_staged", v))
    page_bytes: int
    shape: tuple[int, ...] = attrs.field(converter=int_tuple)
    cache_strides: tuple[int, ...] = attrs.field(converter=int_tuple)
    staging_strides: tuple[int, ...] = attrs.field(converter=int_tuple)
    unit_bytes: int

    def __attrs_post_init__(self) -> None:
        if self.side not in STAGING_SIDES:
            raise PlanError("StagingStep.side", f"unknown side {self.side!r}", actual=self.side,
                            expected=list(STAGING_SIDES), fix="'prefill' for a pack, 'decode' for an unpack")
        for name in ("chunk", "p_rank", "d_rank"):
            check_int(f"StagingStep.{name}", getattr(self, name), minimum=0, error=PlanError)
        for name in ("page_bytes", "unit_bytes"):
            check_int(f"StagingStep.{name}", getattr(self, name), minimum=1, error=PlanError)
        if not len(self.regions) == len(self.offsets) == len(self.staged):
            raise PlanError("StagingStep.regions", "regions, offsets and staged differ in length",
                            actual=(len(self.regions), len(self.offsets), len(self.staged)),
                            fix="give one region, offset and staging offset per layer entry")
        if len(self.pages) != len(self.page_staged):
            raise PlanError("StagingStep.pages", "pages and page_staged differ in length",
                            actual=(len(self.pages), len(self.page_staged)), fix="one staging offset per page")
        if not (len(self.shape) == len(self.cache_strides) == len(self.staging_strides)):
            raise PlanError("StagingStep.shape", "shape, cache_strides and staging_strides differ in length",
                            actual=(self.shape, self.cache_strides, self.staging_strides),
                            fix="give one cache and one staging stride per mode of shape")
        for i, n in enumerate(self.shape):
            check_int(f"StagingStep.shape[{i}]", n, minimum=1, error=PlanError)
        for name in ("cache_strides", "staging_strides"):
            for i, v in enumerate(getattr(self, name)):
                check_int(f"StagingStep.{name}[{i}]", v, minimum=0, error=PlanError)
        span = sum((n - 1) * s for n, s in zip(self.shape, self.cache_strides)) + self.unit_bytes
        if len(self.offsets) and int(self.offsets.max()) + span > self.page_bytes:
            raise PlanError("StagingStep.offsets", f"elements reach byte {int(self.offsets.max()) + span} of a "
                            f"{self.page_bytes} B page", actual=int(self.offsets.max()) + span,
                            expected=f"<= {self.page_bytes}", fix="keep every element inside its page")

    # ---- the one definition of every element's addresses -----------------------------------
    @property
    def rank(self) -> int:
        """The rank that runs the step: ``p_rank`` for a pack, ``d_rank`` for an unpack."""
        return self.p_rank if self.side == "prefill" else self.d_rank

    @property
    def elements(self) -> int:
        """Elements of the pattern (one page entry of one layer entry)."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes the step moves: layer entries x page entries x pattern bytes."""
        return len(self.regions) * len(self.pages) * self.elements * self.unit_bytes

    def pattern_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(cache, staging) offsets of the pattern's elements relative to element 0, first mode outermost."""
        return element_offsets(self.shape, self.cache_strides), element_offsets(self.shape, self.staging_strides)

    def cache_offsets(self, layer: int, pages: Any = slice(None)) -> np.ndarray:
        """``[page entries, elements]``: region byte offset of every element of layer entry ``layer``
        (``pages`` selects page entries)."""
        cache, _ = self.pattern_offsets()
        base = self.pages[pages] * self.page_bytes + int(self.offsets[layer])
        return base[:, None] + cache[None, :]

    def staging_offsets(self, layer: int, pages: Any = slice(None)) -> np.ndarray:
        """``[page entries, elements]``: slot byte offset of every element of layer entry ``layer``."""
        _, staging = self.pattern_offsets()
        base = self.page_staged[pages] + int(self.staged[layer])
        return base[:, None] + staging[None, :]

    def staging_span(self) -> tuple[int, int]:
        """``[first, end)`` of the slot bytes the step touches (its lowest and highest element)."""
        if not (len(self.staged) and len(self.pages)):
            return 0, 0
        hi = sum((n - 1) * s for n, s in zip(self.shape, self.staging_strides)) + self.unit_bytes
        return (int(self.staged.min()) + int(self.page_staged.min()),
                int(self.staged.max()) + int(self.page_staged.max()) + hi)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StagingStep):
            return NotImplemented
        return (self._scalars() == other._scalars()
                and all(np.array_equal(getattr(self, n), getattr(other, n)) for n in _ARRAYS))

    def __hash__(self) -> int:
        return hash((self._scalars(),) + tuple(getattr(self, n).tobytes() for n in _ARRAYS))

    def _scalars(self) -> tuple[Any, ...]:
        return (self.side, self.chunk, self.p_rank, self.d_rank, self.page_bytes, self.shape, self.cache_strides,
                self.staging_strides, self.unit_bytes)

    def __repr__(self) -> str:
        what = "pack" if self.side == "prefill" else "unpack"
        return (f"StagingStep({what} P{self.p_rank}->D{self.d_rank} chunk {self.chunk}: {len(self.regions)} layer "
                f"entries x {len(self.pages)} pages x {self.shape} x {self.unit_bytes} B = {self.nbytes} B)")


_ARRAYS = ("regions", "offsets", "staged", "pages", "page_staged")


def _wire_column(name: str, v: Any) -> np.ndarray:
    arr = np.asarray(v)
    if arr.size == 0:
        arr = arr.reshape(0)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise PlanError(f"WireCopies.{name}", f"must be a vector of integers, got shape {arr.shape} dtype "
                        f"{arr.dtype}", actual=str(arr.dtype), expected="int64", fix="build columns with int64")
    out = np.ascontiguousarray(arr, dtype=np.int64).view()
    out.setflags(write=False)
    return out


@attrs.frozen(eq=False, repr=False)
class WireCopies:
    """Wire rows as int64 columns: ``nbytes`` from P rank ``p_rank``'s slot of ``chunk`` at
    ``p_offset`` to D rank ``d_rank``'s slot of ``chunk`` at ``d_offset`` (one NIXL descriptor each)."""

    chunk: np.ndarray = attrs.field(converter=lambda v: _wire_column("chunk", v))
    p_rank: np.ndarray = attrs.field(converter=lambda v: _wire_column("p_rank", v))
    p_offset: np.ndarray = attrs.field(converter=lambda v: _wire_column("p_offset", v))
    d_rank: np.ndarray = attrs.field(converter=lambda v: _wire_column("d_rank", v))
    d_offset: np.ndarray = attrs.field(converter=lambda v: _wire_column("d_offset", v))
    nbytes: np.ndarray = attrs.field(converter=lambda v: _wire_column("nbytes", v))

    def __attrs_post_init__(self) -> None:
        n = len(self.chunk)
        for c in WIRE_COLUMNS:
            col = getattr(self, c)
            if len(col) != n:
                raise PlanError(f"WireCopies.{c}", f"has {len(col)} rows, chunk has {n}", actual=len(col),
                                expected=n, fix="give every column the same length")
            if n and int(col.min()) < 0:
                raise PlanError(f"WireCopies.{c}", f"holds a negative value {int(col.min())}",
                                actual=int(col.min()), expected=">= 0")
        if n and int(self.nbytes.min()) <= 0:
            raise PlanError("WireCopies.nbytes", "every row must move at least one byte",
                            actual=int(self.nbytes.min()), expected=">= 1")

    def __len__(self) -> int:
        return len(self.chunk)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def take(self, index: Any) -> WireCopies:
        return WireCopies(*(getattr(self, c)[index] for c in WIRE_COLUMNS))

    def as_array(self) -> np.ndarray:
        """An ``(n, 6)`` int64 array in column order."""
        if not len(self):
            return np.zeros((0, len(WIRE_COLUMNS)), np.int64)
        return np.stack([getattr(self, c) for c in WIRE_COLUMNS], axis=1)

    @classmethod
    def empty(cls) -> WireCopies:
        return cls(*(np.zeros(0, np.int64) for _ in WIRE_COLUMNS))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WireCopies):
            return NotImplemented
        return all(np.array_equal(getattr(self, c), getattr(other, c)) for c in WIRE_COLUMNS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, c).tobytes() for c in WIRE_COLUMNS))

    def __repr__(self) -> str:
        return f"WireCopies({len(self)} rows, {self.total_bytes} B)"


@attrs.frozen
class ChunkPiece:
    """What one piece of a chunk moves: group ``group``'s layers ``[layer_start, layer_stop)`` and
    tokens ``[token_start, token_stop)`` (attention) or sections ``[section_start, section_stop)``
    (state; the token fields are then 0)."""

    group: int
    layer_start: int
    layer_stop: int
    token_start: int = 0
    token_stop: int = 0
    section_start: int = 0
    section_stop: int = 0

    def __str__(self) -> str:
        layers = f"layers [{self.layer_start}, {self.layer_stop})"
        if self.section_stop > self.section_start:
            return f"g{self.group} {layers} sections [{self.section_start}, {self.section_stop})"
        return f"g{self.group} {layers} tokens [{self.token_start}, {self.token_stop})"


def _pieces(value: Any) -> tuple[ChunkPiece, ...]:
    out = tuple(value)
    for i, p in enumerate(out):
        if not isinstance(p, ChunkPiece):
            raise PlanError(f"Chunk.pieces[{i}]", f"expected ChunkPiece, got {type(p).__name__}", actual=p)
    return out


@attrs.frozen
class Chunk:
    """One complete pack -> wire -> unpack unit of a packed plan: its pieces, in staging order."""

    index: int
    pieces: tuple[ChunkPiece, ...] = attrs.field(converter=_pieces)

    def __str__(self) -> str:
        return f"chunk {self.index}: " + ", ".join(str(p) for p in self.pieces)
