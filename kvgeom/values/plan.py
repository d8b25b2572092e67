"""The plan container: copies, rearranges and zeros as numpy columns, plus notes.

A plan is data, applied on the D side in this order::

    copies      P rank/region/offset  ->  D rank/region/offset, nbytes      (NIXL descriptor pairs)
    rearranges  in-place permutations of whole D kernel pages (staged strategy)
    chunks      packed strategy, per chunk: packs (P cache -> P staging), wire rows (P staging
                -> D staging, NIXL descriptor pairs), unpacks (D staging -> D cache)
    zeros       D rank/region/offset, nbytes                                (stale bytes)

Offsets are bytes from the start of the region. One global plan serves both executors:
:meth:`TransferPlan.for_decode_rank` (pull: a D rank posts READs) and
:meth:`TransferPlan.for_prefill_rank` (push: a P rank posts WRITEs).

Worked number: a copy row ``(p_rank=1, p_region=0, p_offset=8192, d_rank=0, d_region=0,
d_offset=4096, nbytes=4096)`` moves P rank 1's region-0 bytes [8192, 12288) into D rank 0's
region-0 bytes [4096, 8192).

Rank columns hold flat ranks (docs/design.md §11.1): ``prefill_tp``/``decode_tp`` are the TP sizes
of one stage, ``prefill_ranks``/``decode_ranks`` every rank of the engine (equal to the TP size
for one stage, no DCP groups of their own and one replica). For P PP2 x TP4 -> D TP8 the plan has
``prefill_tp = 4`` and ``prefill_ranks = 8``.
"""

from __future__ import annotations

import contextlib
import contextvars
import html
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np

from ..arith.ints import MAX_INT, checked_product
from ..arith.runs import element_offsets
from ..errors import PlanError
from .fields import as_int, as_tuple, check_int, int_tuple
from .notes import Note, as_notes
from .staging import Chunk, StagingStep, WireCopies
from .text import cut, format_bytes, format_ids, html_block, html_table, text_table

__all__ = ["Copies", "Zeros", "Rearrange", "TransferPlan", "COPY_COLUMNS", "ZERO_COLUMNS", "plan_repr", "plan_html",
           "plan_rank_rows", "plan_pair_bytes", "plan_numbers"]

MAX_PAGES = 1 << 26  # kernel pages one rearrange may list
COPY_COLUMNS = ("p_rank", "p_region", "p_offset", "d_rank", "d_region", "d_offset", "nbytes")
ZERO_COLUMNS = ("d_rank", "d_region", "d_offset", "nbytes")


_PLANNER_COLUMNS: contextvars.ContextVar[bool] = contextvars.ContextVar("kvgeom_planner_columns", default=False)


@contextlib.contextmanager
def planner_columns() -> Iterator[None]:
    """Inside this block :class:`Copies`, :class:`Zeros` and :class:`TransferPlan` skip the scans of
    their column values (non-negative offsets, positive sizes, ranks below the rank counts) and take
    fresh int64 columns as they are (made read-only, not viewed): the compiled planner builds its
    columns from a validated pair and request, non-negative by construction, and those scans are 10
    passes over a plan's columns (25 ms for 10M rows here). Column lengths are still checked. Plans
    from anywhere else (a file, a peer, a connector) are always scanned.
    """
    token = _PLANNER_COLUMNS.set(True)
    try:
        yield
    finally:
        _PLANNER_COLUMNS.reset(token)


def _as_column(name: str, value: Any) -> np.ndarray:
    """A read-only, contiguous int64 column; anything else is a :class:`PlanError` naming it."""
    if (_PLANNER_COLUMNS.get() and type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1
            and value.flags.c_contiguous):
        value.setflags(write=False)  # the planner's own fresh column: no view, no copy
        return value
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.reshape(0)
    if arr.ndim != 1:
        raise PlanError(name, f"must be one-dimensional, got shape {arr.shape}", actual=arr.shape, expected="(n,)")
    if arr.size and arr.dtype.kind not in "iu":
        raise PlanError(name, f"must hold integers, got dtype {arr.dtype}", actual=str(arr.dtype),
                        expected="int64", fix="build columns with dtype=np.int64")
    out = np.ascontiguousarray(arr, dtype=np.int64).view()  # a view: the caller's array stays writable
    out.setflags(write=False)
    return out


class _Columns:
    _names: tuple[str, ...] = ()

    def _check(self) -> None:
        n = len(getattr(self, self._names[0]))
        trusted = _PLANNER_COLUMNS.get()
        for c in self._names:
            col = getattr(self, c)
            if len(col) != n:
                raise PlanError(f"{type(self).__name__}.{c}", f"has {len(col)} rows, {self._names[0]} has {n}",
                                actual=len(col), expected=n, fix="give every column the same length")
            if n and not trusted and int(col.min()) < 0:
                raise PlanError(f"{type(self).__name__}.{c}", f"holds a negative value {int(col.min())}",
                                actual=int(col.min()), expected=">= 0")
            if n and not trusted and int(col.max()) > MAX_INT:  # so that offset + nbytes never wraps in int64
                raise PlanError(f"{type(self).__name__}.{c}", f"holds {int(col.max())}, beyond the largest size "
                                f"kvgeom accepts (2**48)", actual=int(col.max()), expected=f"<= {MAX_INT}",
                                fix="plan rows address regions of at most 2**48 bytes")
        if n and not trusted and int(self.nbytes.min()) <= 0:  # type: ignore[attr-defined]
            raise PlanError(f"{type(self).__name__}.nbytes", "every row must move at least one byte",
                            actual=int(self.nbytes.min()), expected=">= 1")  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(getattr(self, self._names[0]))

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())  # type: ignore[attr-defined]

    def as_array(self) -> np.ndarray:
        """An ``(n, columns)`` int64 array in column order."""
        return np.stack([getattr(self, c) for c in self._names], axis=1) if len(self) else \
            np.zeros((0, len(self._names)), np.int64)

    def take(self, index: Any) -> Any:
        return type(self)(**{c: getattr(self, c)[index] for c in self._names})

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(np.array_equal(getattr(self, c), getattr(other, c)) for c in self._names)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, c).tobytes() for c in self._names))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} rows, {self.total_bytes} B)"

    @classmethod
    def empty(cls) -> Any:
        return cls(**{c: np.zeros(0, np.int64) for c in cls._names})

    @classmethod
    def concat(cls, parts: list[Any]) -> Any:
        if not parts:
            return cls.empty()
        return cls(**{c: np.concatenate([getattr(p, c) for p in parts]) for c in cls._names})


@attrs.frozen(eq=False, repr=False)
class Copies(_Columns):
    """Copy rows as int64 columns (struct of arrays).

    Columns are read-only views of the arrays given (no copy for int64 input, so large plans cost
    no extra pass): hand over arrays you will not modify afterwards.
    """

    _names = COPY_COLUMNS
    p_rank: np.ndarray = attrs.field(converter=lambda v: _as_column("p_rank", v))
    p_region: np.ndarray = attrs.field(converter=lambda v: _as_column("p_region", v))
    p_offset: np.ndarray = attrs.field(converter=lambda v: _as_column("p_offset", v))
    d_rank: np.ndarray = attrs.field(converter=lambda v: _as_column("d_rank", v))
    d_region: np.ndarray = attrs.field(converter=lambda v: _as_column("d_region", v))
    d_offset: np.ndarray = attrs.field(converter=lambda v: _as_column("d_offset", v))
    nbytes: np.ndarray = attrs.field(converter=lambda v: _as_column("nbytes", v))

    def __attrs_post_init__(self) -> None:
        self._check()


@attrs.frozen(eq=False, repr=False)
class Zeros(_Columns):
    """Zero rows as int64 columns."""

    _names = ZERO_COLUMNS
    d_rank: np.ndarray = attrs.field(converter=lambda v: _as_column("d_rank", v))
    d_region: np.ndarray = attrs.field(converter=lambda v: _as_column("d_region", v))
    d_offset: np.ndarray = attrs.field(converter=lambda v: _as_column("d_offset", v))
    nbytes: np.ndarray = attrs.field(converter=lambda v: _as_column("nbytes", v))

    def __attrs_post_init__(self) -> None:
        self._check()


def _ints(path: str, value: Any) -> tuple[Any, ...]:
    return int_tuple(as_tuple(value, path, PlanError, max_len=64))


def _shape(value: Any) -> tuple[Any, ...]:
    return _ints("Rearrange.shape", value)


def _src_strides(value: Any) -> tuple[Any, ...]:
    return _ints("Rearrange.src_strides", value)


def _dst_strides(value: Any) -> tuple[Any, ...]:
    return _ints("Rearrange.dst_strides", value)


def _pages(value: Any) -> tuple[int, ...]:
    """Kernel page ids as a tuple of ints, validated in one vectorized pass (plans list many)."""
    if type(value) is tuple and _PLANNER_COLUMNS.get():
        return value  # the compiled planner's own tuple of page ids (Python ints from a listing)
    if hasattr(value, "__len__") and not isinstance(value, np.ndarray):
        value = as_tuple(value, "Rearrange.pages", PlanError, max_len=MAX_PAGES)
    arr = np.asarray(value if not isinstance(value, (int, np.integer)) else [value])
    if arr.size == 0:
        return ()
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise PlanError("Rearrange.pages", f"must be a sequence of integer page ids, got dtype {arr.dtype}",
                        actual=str(arr.dtype), expected="ints >= 0", fix="pass kernel page ids as ints")
    if int(arr.min()) < 0:
        i = int(np.argmax(arr < 0))
        raise PlanError(f"Rearrange.pages[{i}]", f"must be >= 0, got {int(arr[i])}", actual=int(arr[i]),
                        expected=">= 0", fix="use kernel page ids of the D region")
    return tuple(arr.tolist())


@attrs.frozen
class Rearrange:
    """An in-place permutation of bytes inside each listed D kernel page.

    ``pages`` are kernel page ids of the region (logical block ``b`` is pages ``b*ppl .. b*ppl +
    ppl - 1``): the pages of the request's D blocks that receive data. For every page ``k`` in
    ``pages`` of region ``d_region`` on D rank ``d_rank``, the element at
    multi-index ``i`` (over ``shape``, innermost last, elements of ``unit_bytes`` contiguous bytes)
    moves from ``k*page_bytes + src_offset + sum(i*src_strides)`` to
    ``k*page_bytes + dst_offset + sum(i*dst_strides)``. All sources are read before any write, so
    numpy (``as_strided``) and torch apply it the same way.

    Worked number: NHD -> HND for 2 heads x 4 tokens of 8 B: ``shape=(2, 4)`` (head, token),
    ``src_strides=(8, 16)``, ``dst_strides=(32, 8)``, ``unit_bytes=8``.
    """

    d_rank: int = attrs.field(converter=as_int)
    d_region: int = attrs.field(converter=as_int)
    pages: tuple[int, ...] = attrs.field(converter=_pages)
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    src_strides: tuple[int, ...] = attrs.field(converter=_src_strides)
    dst_strides: tuple[int, ...] = attrs.field(converter=_dst_strides)
    unit_bytes: int = attrs.field(converter=as_int)
    src_offset: int = attrs.field(default=0, converter=as_int)
    dst_offset: int = attrs.field(default=0, converter=as_int)
    page_bytes: int = attrs.field(kw_only=True, converter=as_int)

    def __attrs_post_init__(self) -> None:
        if _PLANNER_COLUMNS.get():
            return  # the compiled planner's rearranges: the reference planner's shapes, checked when compiled
        for name in ("d_rank", "d_region", "src_offset", "dst_offset"):
            check_int(f"Rearrange.{name}", getattr(self, name), minimum=0, error=PlanError)
        for name in ("unit_bytes", "page_bytes"):
            check_int(f"Rearrange.{name}", getattr(self, name), minimum=1, error=PlanError)
        for name in ("src_strides", "dst_strides"):
            for i, v in enumerate(getattr(self, name)):
                check_int(f"Rearrange.{name}[{i}]", v, minimum=0, error=PlanError)
        for i, v in enumerate(self.shape):
            check_int(f"Rearrange.shape[{i}]", v, minimum=1, error=PlanError)
        if not (len(self.shape) == len(self.src_strides) == len(self.dst_strides)):
            raise PlanError("Rearrange.shape", "shape, src_strides and dst_strides differ in length",
                            actual=(self.shape, self.src_strides, self.dst_strides),
                            fix="give one src and one dst stride per mode of shape")
        # a permutation moves at most a page's bytes: bounds the element arrays before they exist
        checked_product("Rearrange.shape", *self.shape, self.unit_bytes, limit=self.page_bytes,
                        what="bytes of one page's elements", error=PlanError,
                        fix="a rearrange permutes the bytes of one page: its elements fit in page_bytes")
        for side, off, strides in (("src", self.src_offset, self.src_strides), ("dst", self.dst_offset, self.dst_strides)):
            end = off + sum((n - 1) * s for n, s in zip(self.shape, strides)) + self.unit_bytes
            if end > self.page_bytes:
                raise PlanError(f"Rearrange.{side}_strides", f"elements reach byte {end} of a {self.page_bytes} B page",
                                actual=end, expected=f"<= {self.page_bytes}",
                                fix="keep every element inside its page")

    @property
    def nbytes_per_page(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.unit_bytes

    def with_pages(self, pages: tuple[int, ...]) -> Rearrange:
        """This rearrange on other ``pages``, without running the checks again: for the compiled
        planner, whose ``self`` was built (and checked) once and whose ``pages`` are a checked
        request's D pages, a tuple of Python ints. Equal to ``attrs.evolve(self, pages=pages)``."""
        new = object.__new__(Rearrange)
        for name in _REARRANGE_FIELDS:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "pages", pages)
        return new

    def src_offsets(self) -> np.ndarray:
        """Page byte offset of every element's source, first mode outermost (the one definition)."""
        return element_offsets(self.shape, self.src_strides, self.src_offset)

    def dst_offsets(self) -> np.ndarray:
        """Page byte offset of every element's destination, in the same element order."""
        return element_offsets(self.shape, self.dst_strides, self.dst_offset)


_REARRANGE_FIELDS = tuple(f.name for f in attrs.fields(Rearrange))


def _rearranges(value: Any) -> tuple[Rearrange, ...]:
    out = as_tuple(value, "TransferPlan.rearranges", PlanError)
    for i, r in enumerate(out):
        if not isinstance(r, Rearrange):
            raise PlanError(f"TransferPlan.rearranges[{i}]", f"expected Rearrange, got {type(r).__name__}", actual=r)
    return out


def _steps(name: str, value: Any) -> tuple[StagingStep, ...]:
    out = tuple(value)
    for i, r in enumerate(out):
        if not isinstance(r, StagingStep):
            raise PlanError(f"TransferPlan.{name}[{i}]", f"expected StagingStep, got {type(r).__name__}", actual=r)
    return out


def _chunks(value: Any) -> tuple[Chunk, ...]:
    out = tuple(value)
    for i, c in enumerate(out):
        if not isinstance(c, Chunk):
            raise PlanError(f"TransferPlan.chunks[{i}]", f"expected Chunk, got {type(c).__name__}", actual=c)
    return out


@attrs.frozen(repr=False)
class TransferPlan:
    """Everything one request's transfer does; see the module docstring for the order.

    A packed plan (docs/design.md §12) has ``packs`` (side "prefill"), ``unpacks`` (side
    "decode"), ``wire`` rows and ``chunks``; ``staging_bytes`` is the slot capacity per rank it
    was planned for (0 for plans without staging).
    """

    prefill_tp: int = attrs.field(converter=as_int)
    decode_tp: int = attrs.field(converter=as_int)
    copies: Copies
    zeros: Zeros
    rearranges: tuple[Rearrange, ...] = attrs.field(default=(), converter=_rearranges)
    notes: tuple[Note, ...] = attrs.field(default=(), converter=as_notes)
    copies_before_coalescing: int = attrs.field(default=-1, converter=as_int)
    zeros_before_coalescing: int = attrs.field(default=-1, converter=as_int)
    prefill_ranks: int = attrs.field(kw_only=True, converter=as_int,
                                     default=attrs.Factory(lambda s: s.prefill_tp, takes_self=True))
    decode_ranks: int = attrs.field(kw_only=True, converter=as_int,
                                    default=attrs.Factory(lambda s: s.decode_tp, takes_self=True))
    packs: tuple[StagingStep, ...] = attrs.field(default=(), converter=lambda v: _steps("packs", v),
                                                   kw_only=True)
    unpacks: tuple[StagingStep, ...] = attrs.field(default=(), converter=lambda v: _steps("unpacks", v),
                                                     kw_only=True)
    wire: WireCopies = attrs.field(factory=WireCopies.empty, kw_only=True)
    chunks: tuple[Chunk, ...] = attrs.field(default=(), converter=_chunks, kw_only=True)
    staging_bytes: int = attrs.field(default=0, kw_only=True, converter=as_int)

    def __attrs_post_init__(self) -> None:
        check_int("TransferPlan.prefill_tp", self.prefill_tp, minimum=1, error=PlanError)
        check_int("TransferPlan.decode_tp", self.decode_tp, minimum=1, error=PlanError)
        for side in ("prefill", "decode"):
            ranks, tp = getattr(self, f"{side}_ranks"), getattr(self, f"{side}_tp")
            check_int(f"TransferPlan.{side}_ranks", ranks, minimum=1, error=PlanError)
            if ranks % tp:
                raise PlanError(f"TransferPlan.{side}_ranks", f"{ranks} ranks are not whole stages of tp={tp}",
                                actual=ranks, expected=f"a multiple of {tp}",
                                fix="ranks = pp * replicas * tp (docs/design.md §11.1)")
        for name, cols in (("copies", self.copies), ("zeros", self.zeros)):
            if not isinstance(cols, Copies if name == "copies" else Zeros):
                raise PlanError(f"TransferPlan.{name}", f"expected {'Copies' if name == 'copies' else 'Zeros'}, got "
                                f"{type(cols).__name__}", actual=type(cols).__name__,
                                fix="build the columns with Copies(...) / Zeros(...)")
        if not _PLANNER_COLUMNS.get():  # the compiled planner's ranks are below the rank counts by construction
            self._check_row_ranks()
        if not isinstance(self.wire, WireCopies):
            raise PlanError("TransferPlan.wire", f"expected WireCopies, got {type(self.wire).__name__}",
                            actual=type(self.wire).__name__, fix="build the rows with WireCopies(...)")
        check_int("TransferPlan.staging_bytes", self.staging_bytes, minimum=0, error=PlanError)
        for col, n, tp in (("p_rank", self.prefill_ranks, self.prefill_tp), ("d_rank", self.decode_ranks, self.decode_tp)):
            arr = getattr(self.wire, col)
            if len(arr) and int(arr.max()) >= n:
                raise PlanError(f"TransferPlan.wire.{col}", f"rank {int(arr.max())} outside {_ranks_text(n, tp)}",
                                actual=int(arr.max()), expected=f"< {n}")
        for name in ("packs", "unpacks"):
            for i, st in enumerate(getattr(self, name)):
                if st.side != ("prefill" if name == "packs" else "decode"):
                    raise PlanError(f"TransferPlan.{name}[{i}].side", f"a step of side {st.side!r} among the {name}",
                                    actual=st.side, fix="packs run on P (side 'prefill'), unpacks on D ('decode')")
                if st.p_rank >= self.prefill_ranks or st.d_rank >= self.decode_ranks:
                    raise PlanError(f"TransferPlan.{name}[{i}]", f"ranks P{st.p_rank} -> D{st.d_rank} outside the "
                                    f"{self.prefill_ranks} -> {self.decode_ranks} ranks", actual=(st.p_rank, st.d_rank))

    def _check_row_ranks(self) -> None:
        for col, n, tp in (("p_rank", self.prefill_ranks, self.prefill_tp), ("d_rank", self.decode_ranks, self.decode_tp)):
            arr = getattr(self.copies, col)
            if len(arr) and int(arr.max()) >= n:
                raise PlanError(f"TransferPlan.copies.{col}", f"rank {int(arr.max())} outside {_ranks_text(n, tp)}",
                                actual=int(arr.max()), expected=f"< {n}")
        for i, r in enumerate(self.rearranges):
            if r.d_rank >= self.decode_ranks:
                raise PlanError(f"TransferPlan.rearranges[{i}].d_rank", f"rank {r.d_rank} outside "
                                f"{_ranks_text(self.decode_ranks, self.decode_tp)}", actual=r.d_rank, expected=f"< {self.decode_ranks}")
        if len(self.zeros) and int(self.zeros.d_rank.max()) >= self.decode_ranks:
            raise PlanError("TransferPlan.zeros.d_rank", f"rank {int(self.zeros.d_rank.max())} outside "
                            f"{_ranks_text(self.decode_ranks, self.decode_tp)}", actual=int(self.zeros.d_rank.max()),
                            expected=f"< {self.decode_ranks}")

    # ---- projections -----------------------------------------------------------------------
    def for_decode_rank(self, d_rank: int) -> TransferPlan:
        """The rows a pull executor on D rank ``d_rank`` posts and applies (packed: its wire rows and
        unpacks, and the packs of the P ranks feeding it): the plan itself when every row is that
        rank's already (one D rank, or a plan made for that rank), plans being immutable."""
        if (self.decode_ranks == 1 and d_rank == 0) or (
                bool(np.all(self.copies.d_rank == d_rank)) and bool(np.all(self.zeros.d_rank == d_rank))
                and bool(np.all(self.wire.d_rank == d_rank))
                and all(r.d_rank == d_rank for r in self.rearranges) and all(x.d_rank == d_rank for x in self.packs)
                and all(x.d_rank == d_rank for x in self.unpacks)):
            return self
        return attrs.evolve(
            self,
            copies=self.copies.take(self.copies.d_rank == d_rank),
            zeros=self.zeros.take(self.zeros.d_rank == d_rank),
            rearranges=tuple(r for r in self.rearranges if r.d_rank == d_rank),
            packs=tuple(s for s in self.packs if s.d_rank == d_rank),
            unpacks=tuple(s for s in self.unpacks if s.d_rank == d_rank),
            wire=self.wire.take(self.wire.d_rank == d_rank),
        )

    def for_prefill_rank(self, p_rank: int) -> Copies:
        """The copies a push executor on P rank ``p_rank`` posts (D applies the rest)."""
        return self.copies.take(self.copies.p_rank == p_rank)

    def packed_for_prefill_rank(self, p_rank: int) -> TransferPlan:
        """What P rank ``p_rank`` does in a packed plan: its packs and wire rows (no D-side steps)."""
        return attrs.evolve(
            self,
            copies=self.copies.take(self.copies.p_rank == p_rank),
            zeros=Zeros.empty(),
            rearranges=(),
            packs=tuple(s for s in self.packs if s.p_rank == p_rank),
            unpacks=(),
            wire=self.wire.take(self.wire.p_rank == p_rank),
        )

    @property
    def packed(self) -> bool:
        """Whether the plan moves bytes through staging (docs/design.md §12)."""
        return bool(len(self.wire) or self.packs or self.unpacks)

    def _pair_keys(self) -> np.ndarray:
        keys = [self.copies.p_rank * self.decode_ranks + self.copies.d_rank]
        if len(self.wire):
            keys.append(self.wire.p_rank * self.decode_ranks + self.wire.d_rank)
        return np.unique(np.concatenate(keys))

    def consumers(self) -> np.ndarray:
        """For every (flat) P rank, how many distinct D ranks read from it (it may free after that many)."""
        out = np.zeros(self.prefill_ranks, np.int64)
        pairs = self._pair_keys()
        if len(pairs):
            np.add.at(out, pairs // self.decode_ranks, 1)
        return out

    def sources_of(self, d_rank: int) -> tuple[int, ...]:
        """The (flat) P ranks D rank ``d_rank`` reads from, sorted: only those holding its layers and tokens."""
        pairs = self._pair_keys()
        return tuple(int(p) for p in pairs[pairs % self.decode_ranks == d_rank] // self.decode_ranks)

    def staging_used(self, side: str) -> np.ndarray:
        """``[chunks, ranks]``: bytes each chunk stages on each (flat) rank of ``side`` ("prefill" or
        "decode"), from the wire rows (a slot holds exactly what crosses the wire)."""
        n = self.prefill_ranks if side == "prefill" else self.decode_ranks
        out = np.zeros((len(self.chunks), n), np.int64)
        w = self.wire
        if len(w):
            rank = w.p_rank if side == "prefill" else w.d_rank
            keep = w.chunk < len(self.chunks)
            np.add.at(out, (w.chunk[keep], rank[keep]), w.nbytes[keep])
        return out

    # ---- summaries -------------------------------------------------------------------------
    @property
    def bytes_copied(self) -> int:
        """Bytes that cross from P to D: copy rows plus wire rows."""
        return self.copies.total_bytes + self.wire.total_bytes

    @property
    def descriptors(self) -> int:
        """NIXL descriptors the plan posts: copy rows plus wire rows."""
        return len(self.copies) + len(self.wire)

    @property
    def bytes_zeroed(self) -> int:
        return self.zeros.total_bytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferPlan):
            return NotImplemented
        return (self.prefill_tp == other.prefill_tp and self.decode_tp == other.decode_tp
                and self.prefill_ranks == other.prefill_ranks and self.decode_ranks == other.decode_ranks
                and self.copies == other.copies and self.zeros == other.zeros
                and self.rearranges == other.rearranges and self.packs == other.packs
                and self.unpacks == other.unpacks and self.wire == other.wire and self.chunks == other.chunks
                and self.staging_bytes == other.staging_bytes)

    def __hash__(self) -> int:
        return hash((self.prefill_tp, self.decode_tp, self.prefill_ranks, self.decode_ranks, self.copies, self.zeros,
                     self.rearranges, self.packs, self.unpacks, self.wire, self.chunks, self.staging_bytes))

    def __repr__(self) -> str:
        return plan_repr(self)

    def _repr_html_(self) -> str:
        return plan_html(self)


# ---- text and HTML ----------------------------------------------------------------------------------

MAX_MATRIX_TP = 8  # P->D byte matrices up to 8 x 8; larger plans list the non-zero pairs


def _ranks_text(n: int, tp: int) -> str:
    return f"tp={tp}" if n == tp else f"the {n} ranks"


def plan_rank_rows(p: TransferPlan) -> list[list[Any]]:
    """Per D rank: its P sources, copies, bytes, zero ranges, zero bytes, rearranged pages. A
    packed plan shows its wire rows as the copies (they are what NIXL posts) and the D pages its
    unpacks write instead of rearranged pages."""
    d_tp = p.decode_ranks
    c, z, w = p.copies, p.zeros, p.wire
    n_copies = np.bincount(c.d_rank, minlength=d_tp) + np.bincount(w.d_rank, minlength=d_tp)
    b_copies = np.bincount(c.d_rank, weights=c.nbytes, minlength=d_tp) \
        + np.bincount(w.d_rank, weights=w.nbytes, minlength=d_tp)
    n_zeros = np.bincount(z.d_rank, minlength=d_tp)
    b_zeros = np.bincount(z.d_rank, weights=z.nbytes, minlength=d_tp)
    pages = np.zeros(d_tp, np.int64)
    for r in p.rearranges:
        pages[r.d_rank] += len(r.pages)
    for st in p.unpacks:
        pages[st.d_rank] += len(st.pages) * len(st.regions)
    packed = p.packed
    rows: list[list[Any]] = [["D rank", "from P", "wire rows" if packed else "copies", "bytes", "zero ranges",
                              "zero B", "unpacked pages" if packed else "rearranged pages"]]
    for d in range(d_tp):
        src = format_ids(p.sources_of(d), limit=4)
        rows.append([d, src, int(n_copies[d]), int(b_copies[d]), int(n_zeros[d]), int(b_zeros[d]), int(pages[d])])
    return rows


def plan_numbers(p: TransferPlan) -> dict[str, Any]:
    """A plan's totals under the names ``kvgeom plan --json`` and ``kvgeom transfer --json`` both use.

    ``copies``: copy rows (0 for a packed plan); ``wire_descriptors``: what NIXL posts (copy rows
    plus wire rows: ``copies`` for direct and staged plans, the wire rows for packed ones);
    ``bytes``/``zero_bytes``: bytes copied and zeroed; ``staging_bytes``: the chunk capacity a
    packed plan was cut for (0 otherwise) and ``staging_per_*_rank`` the most any chunk stages there.
    """
    return {
        "prefill_ranks": p.prefill_ranks,
        "decode_ranks": p.decode_ranks,
        "copies": len(p.copies),
        "copies_before_coalescing": p.copies_before_coalescing,
        "bytes": p.bytes_copied,
        "zeros": len(p.zeros),
        "zero_bytes": p.bytes_zeroed,
        "rearranges": len(p.rearranges),
        "packed": p.packed,
        "wire_descriptors": p.descriptors,
        "chunks": len(p.chunks),
        "packs": len(p.packs),
        "unpacks": len(p.unpacks),
        "staging_bytes": p.staging_bytes,
        "staging_per_prefill_rank": [int(x) for x in p.staging_used("prefill").max(axis=0, initial=0)],
        "staging_per_decode_rank": [int(x) for x in p.staging_used("decode").max(axis=0, initial=0)],
    }


def plan_pair_bytes(p: TransferPlan) -> dict[tuple[int, int], int]:
    """Bytes each (P rank, D rank) pair moves (copies and wire rows), non-zero pairs only, sorted."""
    c, w = p.copies, p.wire
    if not len(c) and not len(w):
        return {}
    key = np.concatenate([c.p_rank * p.decode_ranks + c.d_rank, w.p_rank * p.decode_ranks + w.d_rank])
    nbytes = np.concatenate([c.nbytes, w.nbytes])
    uniq, inv = np.unique(key, return_inverse=True)
    sums = np.bincount(inv.reshape(-1), weights=nbytes)
    return {(int(k) // p.decode_ranks, int(k) % p.decode_ranks): int(s) for k, s in zip(uniq, sums, strict=True)}


def _pair_rows(p: TransferPlan) -> list[list[Any]]:
    pairs = plan_pair_bytes(p)
    if p.prefill_ranks <= MAX_MATRIX_TP and p.decode_ranks <= MAX_MATRIX_TP:
        rows: list[list[Any]] = [["bytes"] + [f"D{d}" for d in range(p.decode_ranks)]]
        for q in range(p.prefill_ranks):
            rows.append([f"P{q}"] + [pairs.get((q, d), 0) for d in range(p.decode_ranks)])
        return rows
    rows = [["P rank", "D rank", "bytes"]]
    rows.extend([q, d, b] for (q, d), b in pairs.items())
    return cut(rows)


def _side_text(tp: int, ranks: int) -> str:
    return f"TP{tp}" if ranks == tp else f"TP{tp} ({ranks} ranks)"


def _plan_title(p: TransferPlan) -> str:
    return (f"TransferPlan P {_side_text(p.prefill_tp, p.prefill_ranks)} -> D {_side_text(p.decode_tp, p.decode_ranks)}"
            + (" (packed)" if p.packed else ""))


def _plan_lines(p: TransferPlan) -> list[str]:
    before = p.copies_before_coalescing
    before_text = f" ({before:,} before coalescing)" if before >= 0 else ""
    lines = []
    if p.packed:
        used_p, used_d = p.staging_used("prefill"), p.staging_used("decode")
        lines.append(f"wire rows: {len(p.wire):,} in {len(p.chunks)} chunk{'s' if len(p.chunks) != 1 else ''}, "
                     f"{format_bytes(p.wire.total_bytes)}; packs: {len(p.packs)} steps, unpacks: {len(p.unpacks)} "
                     "steps")
        lines.append(f"staging per rank and chunk: P up to {format_bytes(int(used_p.max(initial=0)))}, D up to "
                     f"{format_bytes(int(used_d.max(initial=0)))} (slot {format_bytes(p.staging_bytes)})")
    if len(p.copies) or not p.packed:
        lines.append(f"copies: {len(p.copies):,}{before_text}, {format_bytes(p.copies.total_bytes)}")
    lines.append(f"zeros: {len(p.zeros):,} ranges, {format_bytes(p.bytes_zeroed)}; rearranges: {len(p.rearranges)} "
                 f"({sum(len(r.pages) for r in p.rearranges):,} pages)")
    return lines


def plan_repr(p: TransferPlan) -> str:
    lines = [_plan_title(p)] + [" " + line for line in _plan_lines(p)]
    lines.append(text_table(cut(plan_rank_rows(p))))
    lines.append(" bytes per P rank -> D rank:")
    lines.append(text_table(_pair_rows(p), indent="   "))
    if p.notes:
        lines.append(" notes:")
        lines.extend(f"   - {n.text}" for n in p.notes)
    return "\n".join(lines)


def plan_html(p: TransferPlan) -> str:
    tables = [html_table(cut(plan_rank_rows(p)), "per D rank"),
              html_table(_pair_rows(p), "bytes per P rank -> D rank")]
    if p.notes:
        tables.append("<ul>" + "".join(f"<li>{html.escape(n.text)}</li>" for n in p.notes) + "</ul>")
    return html_block(_plan_title(p), _plan_lines(p), tables)
