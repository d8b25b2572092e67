"""A connector's own transfer, in kvgeom's units: copy and zero rows that keep the connector's ids.

A connector's tests hold what the connector posts: descriptor pairs and the byte ranges its
receive step zeroes. They come in one of two forms, and both end up as :class:`ConnectorRows`::

    (rank, region, offset, length)              ConnectorRows.from_rows(copies, zeros, copy_ids=...)
    vLLM's terms: per-region base addresses,     rows_from_descriptors(pair, prefill_bases=..., decode_bases=...,
      descriptor tables (address, length) and      reads=[Read(d_rank, p_rank, local table, local ids,
      the ids each READ pairs, positionally        remote table, remote ids)], zeros=[(d_rank, addr, len)])

An address is resolved to ``(region, offset)`` through the rank's region base addresses (the
``kv_caches_base_addr`` the handshake carries); one that lies in no region cannot become a row and
is returned as an unresolved descriptor instead. Each row keeps the connector's ids (columns named
by ``id_names``: a descriptor id, or ``read``, ``local`` and ``remote``) so that findings can be
reported in the connector's terms.

Everything here is checked as hostile input (docs/design.md §14): each value must be an int in
``[0, 2**48]`` (:class:`~kvgeom.errors.PlanError` naming ``copies[i][j]``, ``zeros[k][1]``...),
counts are bounded on ``len()`` before anything is converted (``max_rows``, default
:data:`MAX_CONNECTOR_ROWS`, refused with :class:`~kvgeom.errors.PlanBudgetExceeded`;
:data:`MAX_DESCRIPTORS` per table), and an integer array is checked in one vectorised pass.

Worked number: D region 0 based at 0x100000 with 96-byte kernel pages; local sub-descriptor 19 of
a 48-byte dlist is ``(0x100000 + 19 * 48, 48)``, i.e. region 0 offset 912 = page 9 byte 48.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..arith.ints import MAX_INT
from ..errors import IncompatibleGeometry, PlanBudgetExceeded, PlanError, value_text
from ..values.fields import as_int, check_instance, check_int, check_str
from ..values.pair import CheckedEngines
from ..values.plan import COPY_COLUMNS, ZERO_COLUMNS, Copies, Rearrange, TransferPlan, Zeros

__all__ = ["ConnectorRows", "DescriptorTable", "Read", "Unresolved", "rows_from_descriptors", "MAX_CONNECTOR_ROWS",
           "MAX_DESCRIPTORS"]

# default max_rows: copy plus zero rows (or READ pairs) one check builds and simulates (2**20 rows: about 3 s
# and 400 MB of simulation on a 2-core machine; 2**22: 14 s)
MAX_CONNECTOR_ROWS = 1 << 20
MAX_DESCRIPTORS = 1 << 26  # entries of one descriptor table (or one READ's id list)
_MAX_ID_NAMES = 16


def check_max_rows(max_rows: Any) -> int | None:
    """``max_rows`` as an int >= 1, or None (no bound)."""
    return None if max_rows is None else check_int("max_rows", max_rows, minimum=1, error=PlanError)


def over_budget(path: str, n: int, max_rows: int | None, what: str) -> None:
    """:class:`PlanBudgetExceeded` when ``n`` rows exceed ``max_rows`` (checked before they are built)."""
    if max_rows is not None and n > max_rows:
        raise PlanBudgetExceeded(path, f"{value_text(n)} {what} exceed max_rows={max_rows}", actual=n,
                                 expected=f"<= {max_rows}",
                                 fix=f"pass max_rows={n} (or max_rows=None) to check a transfer this large")


def _int_array(path: str, value: Any, *, ndims: tuple[int, ...], max_len: int, minimum: int = 0,
               budget: bool = False) -> np.ndarray:
    """``value`` as an int64 array of one of ``ndims`` dimensions, entries ints in ``[minimum, MAX_INT]``.

    Its length is checked against ``max_len`` before anything is converted; an integer array is
    checked in one vectorised pass, anything else (big ints, strings, None, floats, nested lists)
    entry by entry, naming the first bad one (``path[i][j]``).
    """
    if value is None or isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__") or (
            isinstance(value, np.ndarray) and value.ndim == 0):
        raise PlanError(path, f"must be a sequence of integers, got {type(value).__name__} {value_text(value, 60)}",
                        actual=value_text(value, 60), expected="a list or an integer array",
                        fix="pass a list of ints or an int64 array")
    try:
        n = len(value)
    except (TypeError, OverflowError):
        n = max_len + 1
    if n > max_len:
        if budget:
            over_budget(path, n, max_len, "rows")
        raise PlanError(path, f"{value_text(n)} entries exceed the {max_len} kvgeom accepts", actual=n,
                        expected=f"<= {max_len} entries", fix="pass fewer entries (is the input real?)")
    arr: np.ndarray | None
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        arr = None  # ragged or unconvertible: read entry by entry below
    if arr is None or arr.dtype.kind not in "iu":
        try:
            arr = np.array(value, dtype=object)
        except (ValueError, TypeError, OverflowError) as e:
            raise PlanError(path, f"cannot be read as integers: {e}", actual=value_text(value, 60),
                            expected="a list or an integer array", fix="pass a list of ints or an int64 array") from None
    if arr.size == 0:
        return arr.astype(np.int64) if arr.ndim in ndims else np.zeros((0,) * min(ndims), np.int64)
    if arr.ndim < min(ndims):
        raise PlanError(path, f"must have {min(ndims)} dimension(s), got shape {arr.shape}", actual=arr.shape,
                        expected=f"{min(ndims)} dimension(s)", fix="one sequence of integers per row")
    if arr.ndim > max(ndims):  # entries that are themselves sequences
        index = np.unravel_index(0, arr.shape)[:max(ndims)]
        check_int(path + "".join(f"[{i}]" for i in index), arr[index].tolist(), minimum=minimum, error=PlanError)
    if arr.dtype == object:
        for flat, v in enumerate(arr.flat):
            if type(v) is not int or not minimum <= v <= MAX_INT:
                index = np.unravel_index(flat, arr.shape)
                check_int(path + "".join(f"[{i}]" for i in index), v, minimum=minimum, error=PlanError)
        return arr.astype(np.int64)
    bad = np.flatnonzero((arr < minimum) | (arr > MAX_INT))
    if bad.size:
        index = np.unravel_index(int(bad[0]), arr.shape)
        check_int(path + "".join(f"[{i}]" for i in index), arr[index], minimum=minimum, error=PlanError)
    return arr.astype(np.int64, copy=False)


def _ids(value: Any, n: int, names: tuple[str, ...], path: str) -> np.ndarray:
    if value is None:
        return np.arange(n, dtype=np.int64).reshape(n, 1)
    try:
        given = len(value)
    except (TypeError, OverflowError):
        given = None  # not a sequence: refused by _int_array
    if given is not None and given != n:
        raise PlanError(path, f"{value_text(given)} ids for {n} rows", actual=given, expected=n,
                        fix="give one id (per id name) per row")
    arr = _int_array(path, value, ndims=(1, 2), max_len=n)
    if arr.size == 0 and n == 0:
        return np.zeros((0, len(names)), np.int64)
    if arr.ndim == 1:
        arr = arr.reshape(-1, 1)
    if arr.shape != (n, len(names)):
        raise PlanError(path, f"ids of shape {arr.shape} for {n} rows named {names}", actual=arr.shape,
                        expected=(n, len(names)), fix="give one id (per id name) per row")
    return arr


def _columns(value: Any, names: tuple[str, ...], path: str, max_rows: int | None) -> dict[str, np.ndarray]:
    if value is None:  # no rows
        value = ()
    arr = _int_array(path, value, ndims=(2,), max_len=MAX_INT if max_rows is None else max_rows, budget=True)
    if arr.size == 0:
        arr = np.zeros((0, len(names)), np.int64)
    if arr.ndim != 2 or arr.shape[1] != len(names):
        raise PlanError(path, f"rows of shape {arr.shape}", actual=arr.shape, expected=f"(n, {len(names)}): {names}",
                        fix="one row per descriptor, columns in that order")
    return {c: arr[:, i].copy() for i, c in enumerate(names)}


def _names(path: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not 1 <= len(value) <= _MAX_ID_NAMES:
        raise PlanError(path, f"expected 1 to {_MAX_ID_NAMES} id names, got {value_text(value, 60)}",
                        actual=value_text(value, 60), expected=f"a tuple of 1 to {_MAX_ID_NAMES} strings",
                        fix='pass e.g. ("descriptor",)')
    return tuple(check_str(f"{path}[{i}]", v, error=PlanError) for i, v in enumerate(value))


@attrs.frozen(eq=False)
class ConnectorRows:
    """A connector's copies and zeros as kvgeom rows, each with the connector's ids.

    ``copy_ids`` / ``zero_ids`` are ``(rows, len(id_names))`` int64 arrays; :meth:`label` says a
    row's ids in words (``"read 0 local 19 remote 17"``).
    """

    copies: Copies
    zeros: Zeros
    copy_ids: np.ndarray
    zero_ids: np.ndarray
    id_names: tuple[str, ...] = ("descriptor",)
    zero_id_names: tuple[str, ...] = ("zero",)
    rearranges: tuple[Rearrange, ...] = ()

    def __attrs_post_init__(self) -> None:
        check_instance("ConnectorRows.copies", self.copies, Copies, error=PlanError,
                       fix="use ConnectorRows.from_rows(...)")
        check_instance("ConnectorRows.zeros", self.zeros, Zeros, error=PlanError, fix="use ConnectorRows.from_rows(...)")
        for what, ids, names, n in (("copy", self.copy_ids, self.id_names, len(self.copies)),
                                    ("zero", self.zero_ids, self.zero_id_names, len(self.zeros))):
            names = _names(f"ConnectorRows.{'zero_' if what == 'zero' else ''}id_names", names)
            check_instance(f"ConnectorRows.{what}_ids", ids, np.ndarray, error=PlanError,
                           fix="use ConnectorRows.from_rows(...)")
            if ids.dtype != np.int64 or ids.shape != (n, len(names)):
                raise PlanError(f"ConnectorRows.{what}_ids", f"ids of dtype {ids.dtype} and shape {ids.shape}",
                                actual=ids.shape, expected=f"int64 of shape {(n, len(names))}",
                                fix="use ConnectorRows.from_rows(...)")
        if not isinstance(self.rearranges, tuple):
            raise PlanError("ConnectorRows.rearranges", f"expected a tuple, got {type(self.rearranges).__name__}",
                            actual=value_text(self.rearranges, 60), expected="a tuple of Rearrange",
                            fix="use ConnectorRows.from_rows(...)")
        for i, r in enumerate(self.rearranges):
            check_instance(f"ConnectorRows.rearranges[{i}]", r, Rearrange, error=PlanError)

    @classmethod
    def from_rows(cls, copies: Any = (), zeros: Any = (), *, copy_ids: Any = None, zero_ids: Any = None,
                  id_names: Sequence[str] = ("descriptor",), zero_id_names: Sequence[str] = ("zero",),
                  rearranges: Sequence[Rearrange] = (),
                  max_rows: int | None = MAX_CONNECTOR_ROWS) -> ConnectorRows:
        """Rows as ``(p_rank, p_region, p_offset, d_rank, d_region, d_offset, nbytes)`` and
        ``(d_rank, d_region, d_offset, nbytes)`` (sequences, arrays, or :class:`Copies` /
        :class:`Zeros`); ids default to the row numbers.

        Every value must be an int in ``[0, 2**48]`` (:class:`~kvgeom.errors.PlanError` naming
        ``copies[i][j]`` otherwise); more than ``max_rows`` copy or zero rows raise
        :class:`~kvgeom.errors.PlanBudgetExceeded` before any is converted.
        """
        limit = check_max_rows(max_rows)
        c = copies if isinstance(copies, Copies) else Copies(**_columns(copies, COPY_COLUMNS, "copies", limit))
        z = zeros if isinstance(zeros, Zeros) else Zeros(**_columns(zeros, ZERO_COLUMNS, "zeros", limit))
        over_budget("copies", len(c), limit, "copy rows")
        over_budget("zeros", len(z), limit, "zero rows")
        names, znames = _names("id_names", id_names), _names("zero_id_names", zero_id_names)
        if isinstance(rearranges, (str, bytes)) or not isinstance(rearranges, Sequence):
            raise PlanError("rearranges", f"expected a sequence of Rearrange, got {type(rearranges).__name__}",
                            actual=value_text(rearranges, 60), expected="a tuple of Rearrange", fix="pass ()")
        over_budget("rearranges", len(rearranges), limit, "rearranges")
        return cls(c, z, _ids(copy_ids, len(c), names, "copy_ids"), _ids(zero_ids, len(z), znames, "zero_ids"),
                   names, znames, tuple(rearranges))

    @classmethod
    def from_plan(cls, plan: TransferPlan, *, max_rows: int | None = MAX_CONNECTOR_ROWS) -> ConnectorRows:
        """kvgeom's own plan as a connector's rows (ids: row numbers), to compare like with like."""
        check_instance("plan", plan, TransferPlan, error=PlanError)
        return cls.from_rows(plan.copies, plan.zeros, id_names=("row",), zero_id_names=("zero row",),
                             rearranges=plan.rearranges, max_rows=max_rows)

    def label(self, row: int, *, zero: bool = False) -> str:
        names, ids = (self.zero_id_names, self.zero_ids) if zero else (self.id_names, self.copy_ids)
        return " ".join(f"{n} {int(v)}" for n, v in zip(names, ids[row]))


def _addresses(value: Any) -> np.ndarray:
    return _int_array("DescriptorTable.addresses", value, ndims=(1,), max_len=MAX_DESCRIPTORS)


def _lengths(value: Any) -> np.ndarray:
    return _int_array("DescriptorTable.lengths", value, ndims=(1,), max_len=MAX_DESCRIPTORS)


def _local_ids(value: Any) -> np.ndarray:
    return _int_array("Read.local_ids", value, ndims=(1,), max_len=MAX_DESCRIPTORS)


def _remote_ids(value: Any) -> np.ndarray:
    return _int_array("Read.remote_ids", value, ndims=(1,), max_len=MAX_DESCRIPTORS)


@attrs.frozen(eq=False)
class DescriptorTable:
    """One NIXL descriptor list (vLLM's dlist): descriptor id ``i`` is ``addresses[i], lengths[i]``.

    Addresses and lengths are ints in ``[0, 2**48]`` (lengths >= 1), at most ``MAX_DESCRIPTORS``
    of them; anything else is a :class:`~kvgeom.errors.PlanError` naming the entry.
    """

    addresses: np.ndarray = attrs.field(converter=_addresses)
    lengths: np.ndarray = attrs.field(converter=_lengths)

    def __attrs_post_init__(self) -> None:
        if self.addresses.shape != self.lengths.shape:
            raise PlanError("DescriptorTable", f"{self.addresses.size} addresses for {self.lengths.size} lengths",
                            actual=(self.addresses.size, self.lengths.size), fix="one length per address")
        if self.lengths.size and int(self.lengths.min()) <= 0:
            raise PlanError("DescriptorTable.lengths", "a descriptor of no bytes", actual=int(self.lengths.min()),
                            expected=">= 1")

    @classmethod
    def from_descs(cls, descs: Any) -> DescriptorTable:
        """From ``[(address, length), ...]`` or ``[(address, length, device), ...]`` (vLLM's tuples)."""
        arr = _int_array("descs", descs, ndims=(2,), max_len=MAX_DESCRIPTORS)
        if arr.size == 0:
            arr = np.zeros((0, 2), np.int64)
        if arr.ndim != 2 or arr.shape[1] not in (2, 3):
            raise PlanError("descs", f"descriptors of shape {arr.shape}", actual=arr.shape,
                            expected="(n, 2) or (n, 3)", fix="(address, length[, device]) per descriptor")
        return cls(arr[:, 0], arr[:, 1])

    def __len__(self) -> int:
        return int(self.addresses.size)


@attrs.frozen(eq=False)
class Read:
    """One READ a D rank posts (vLLM: ``make_prepped_xfer("READ", local, local_ids, remote, remote_ids)``):
    local descriptor ``local_ids[j]`` receives remote descriptor ``remote_ids[j]`` of P rank ``p_rank``."""

    d_rank: int = attrs.field(converter=as_int)
    p_rank: int = attrs.field(converter=as_int)
    local: DescriptorTable
    local_ids: np.ndarray = attrs.field(converter=_local_ids)
    remote: DescriptorTable
    remote_ids: np.ndarray = attrs.field(converter=_remote_ids)

    def __attrs_post_init__(self) -> None:
        check_int("Read.d_rank", self.d_rank, minimum=0, error=PlanError)
        check_int("Read.p_rank", self.p_rank, minimum=0, error=PlanError)
        for name in ("local", "remote"):
            check_instance(f"Read.{name}", getattr(self, name), DescriptorTable, error=PlanError,
                           fix="build the table with DescriptorTable(addresses, lengths) or DescriptorTable.from_descs")


@attrs.frozen
class Unresolved:
    """A descriptor whose bytes lie in no registered region of its rank (it cannot be simulated)."""

    side: str
    rank: int = attrs.field(converter=as_int)
    address: int = attrs.field(converter=as_int)
    nbytes: int = attrs.field(converter=as_int)
    label: str

    def __attrs_post_init__(self) -> None:
        if self.side not in ("prefill", "decode"):
            raise PlanError("Unresolved.side", f"must be 'prefill' or 'decode', got {value_text(self.side, 60)}",
                            actual=value_text(self.side, 60), expected="'prefill' or 'decode'")
        check_int("Unresolved.rank", self.rank, minimum=0, error=PlanError)
        check_int("Unresolved.address", self.address, minimum=0, error=PlanError)
        check_int("Unresolved.nbytes", self.nbytes, minimum=1, error=PlanError)
        check_str("Unresolved.label", self.label, error=PlanError)


def _resolve(bases: np.ndarray, sizes: np.ndarray, addr: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(region, offset) of each ``[addr, addr + n)`` inside one region, region -1 when none holds it."""
    region = np.full(addr.size, -1, np.int64)
    offset = np.zeros(addr.size, np.int64)
    if not addr.size:
        return region, offset
    for r in range(bases.size):
        inside = (region < 0) & (addr >= bases[r]) & (addr + n <= bases[r] + sizes[r])
        region[inside] = r
        offset[inside] = addr[inside] - bases[r]
    return region, offset


def _bases(value: Any, ranks: int, nregions: int, path: str) -> np.ndarray:
    arr = _int_array(path, value, ndims=(2,), max_len=ranks)
    if arr.shape != (ranks, nregions):
        raise PlanError(path, f"base addresses of shape {arr.shape}", actual=arr.shape, expected=(ranks, nregions),
                        fix="one base address per region (kv_caches_base_addr) per rank")
    return arr


def _held_sizes(engine: Any, rank: int) -> np.ndarray:
    """Bytes of every region on ``rank``: 0 for the regions of another pipeline stage (docs/design.md §11.4)."""
    held = set(engine.rank_regions(rank))
    return np.array([r.nbytes if i in held else 0 for i, r in enumerate(engine.regions)], np.int64)


def _outside(n: int, tp: int) -> str:
    return f"tp {tp}" if n == tp else f"{n} ranks"


def rows_from_descriptors(
    pair: CheckedEngines,
    *,
    prefill_bases: Any,
    decode_bases: Any,
    reads: Sequence[Read],
    zeros: Sequence[tuple[int, int, int]] = (),
    max_rows: int | None = MAX_CONNECTOR_ROWS,
) -> tuple[ConnectorRows, tuple[Unresolved, ...]]:
    """vLLM-style READs and zero ranges as :class:`ConnectorRows` (ids: read, local id, remote id).

    ``*_bases[rank][region]`` is the address of each region of each rank. ``zeros`` are
    ``(d_rank, address, nbytes)``. Descriptor pairs of different lengths, ids outside their tables,
    ranks outside the engines and values that are not ints in ``[0, 2**48]`` raise
    :class:`~kvgeom.errors.PlanError` (NIXL would refuse them); bytes outside every region are
    returned as :class:`Unresolved` (the report lists them). More than ``max_rows`` READs, READ
    pairs or zero ranges raise :class:`~kvgeom.errors.PlanBudgetExceeded` before any is resolved.
    """
    check_instance("pair", pair, CheckedEngines, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    limit = check_max_rows(max_rows)
    P, D = pair.prefill, pair.decode
    pb = _bases(prefill_bases, P.num_ranks, len(P.regions), "prefill_bases")
    db = _bases(decode_bases, D.num_ranks, len(D.regions), "decode_bases")
    if isinstance(reads, (str, bytes)) or not isinstance(reads, Sequence):
        raise PlanError("reads", f"expected a sequence of Read, got {type(reads).__name__} {value_text(reads, 60)}",
                        actual=value_text(reads, 60), expected="a list of Read", fix="pass [Read(...), ...]")
    over_budget("reads", len(reads), limit, "READs")
    for k, rd in enumerate(reads):
        check_instance(f"reads[{k}]", rd, Read, error=PlanError, fix="describe each READ with Read(...)")
    over_budget("reads", sum(int(rd.local_ids.size) for rd in reads), limit, "READ descriptor pairs")
    zarr = _int_array("zeros", zeros, ndims=(2,), max_len=MAX_INT if limit is None else limit, budget=True)
    if zarr.size == 0:
        zarr = np.zeros((0, 3), np.int64)
    if zarr.shape[1] != 3:
        raise PlanError("zeros", f"zero ranges of shape {zarr.shape}", actual=zarr.shape, expected="(n, 3)",
                        fix="one (d_rank, address, nbytes) per zero range")
    cols: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    unresolved: list[Unresolved] = []
    sizes: dict[tuple[str, int], np.ndarray] = {}

    def held(engine: Any, side: str, rank: int) -> np.ndarray:
        if (side, rank) not in sizes:
            sizes[side, rank] = _held_sizes(engine, rank)
        return sizes[side, rank]

    for k, rd in enumerate(reads):
        path = f"reads[{k}]"
        d, p = rd.d_rank, rd.p_rank
        if d >= D.num_ranks or p >= P.num_ranks:
            what = f"tp {D.tp} / {P.tp}" if (D.num_ranks, P.num_ranks) == (D.tp, P.tp) else \
                f"{D.num_ranks} / {P.num_ranks} ranks"
            raise PlanError(path, f"ranks D {d} / P {p} outside {what}", actual=(d, p),
                            expected=(D.num_ranks, P.num_ranks), fix="name ranks of the engines")
        if rd.local_ids.size != rd.remote_ids.size:
            raise PlanError(path, f"{rd.local_ids.size} local ids paired with {rd.remote_ids.size} remote ids",
                            actual=(rd.local_ids.size, rd.remote_ids.size), fix="pair the ids positionally")
        for side, table, want in (("local", rd.local, rd.local_ids), ("remote", rd.remote, rd.remote_ids)):
            if want.size and (int(want.min()) < 0 or int(want.max()) >= len(table)):
                raise PlanError(f"{path}.{side}_ids", f"descriptor id outside the {len(table)}-entry table",
                                actual=int(want.max()), expected=f"< {len(table)}", fix="use ids of that table")
        la, ll = rd.local.addresses[rd.local_ids], rd.local.lengths[rd.local_ids]
        ra, rl = rd.remote.addresses[rd.remote_ids], rd.remote.lengths[rd.remote_ids]
        bad = np.flatnonzero(ll != rl)
        if bad.size:
            j = int(bad[0])
            raise PlanError(f"{path}[{j}]", f"local descriptor {int(rd.local_ids[j])} has {int(ll[j])} B, remote "
                            f"descriptor {int(rd.remote_ids[j])} has {int(rl[j])} B", actual=(int(ll[j]), int(rl[j])),
                            expected="equal lengths", fix="NIXL pairs descriptors of equal length only")
        dreg, doff = _resolve(db[d], held(D, "decode", d), la, ll)
        preg, poff = _resolve(pb[p], held(P, "prefill", p), ra, rl)
        for j in np.flatnonzero((dreg < 0) | (preg < 0)).tolist():
            label = f"read {k} local {int(rd.local_ids[j])} remote {int(rd.remote_ids[j])}"
            if dreg[j] < 0:
                unresolved.append(Unresolved("decode", d, int(la[j]), int(ll[j]), label))
            if preg[j] < 0:
                unresolved.append(Unresolved("prefill", p, int(ra[j]), int(rl[j]), label))
        ok = (dreg >= 0) & (preg >= 0)
        n = int(ok.sum())
        cols.append(np.stack([np.full(n, p), preg[ok], poff[ok], np.full(n, d), dreg[ok], doff[ok], ll[ok]], axis=1))
        ids.append(np.stack([np.full(n, k), rd.local_ids[ok], rd.remote_ids[ok]], axis=1))
    zd, zaddr, zn = zarr[:, 0], zarr[:, 1], zarr[:, 2]
    for k in np.flatnonzero((zn < 1) | (zd >= D.num_ranks))[:1].tolist():
        check_int(f"zeros[{k}].nbytes", int(zn[k]), minimum=1, error=PlanError)
        raise PlanError(f"zeros[{k}].d_rank", f"rank {int(zd[k])} outside {_outside(D.num_ranks, D.tp)}",
                        actual=int(zd[k]), expected=f"< {D.num_ranks}")
    zreg, zoff = np.full(zd.size, -1, np.int64), np.zeros(zd.size, np.int64)
    for d in np.unique(zd).tolist():  # at most D's ranks
        mine = zd == d
        zreg[mine], zoff[mine] = _resolve(db[d], held(D, "decode", d), zaddr[mine], zn[mine])
    for k in np.flatnonzero(zreg < 0).tolist():
        unresolved.append(Unresolved("decode", int(zd[k]), int(zaddr[k]), int(zn[k]), f"zero {k}"))
    zok = np.flatnonzero(zreg >= 0)
    zcols = np.stack([zd[zok], zreg[zok], zoff[zok], zn[zok]], axis=1) if zok.size else np.zeros((0, 4), np.int64)
    copies = np.concatenate(cols) if cols else np.zeros((0, 7), np.int64)
    copy_ids = np.concatenate(ids) if ids else np.zeros((0, 3), np.int64)
    rows = ConnectorRows.from_rows(copies, zcols, copy_ids=copy_ids, zero_ids=zok.astype(np.int64),
                                   id_names=("read", "local", "remote"),
                                   max_rows=max_rows)
    return rows, tuple(unresolved)
