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

Worked number: D region 0 based at 0x100000 with 96-byte kernel pages; local sub-descriptor 19 of
a 48-byte dlist is ``(0x100000 + 19 * 48, 48)``, i.e. region 0 offset 912 = page 9 byte 48.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import PlanError
from ..values.fields import check_int
from ..values.pair import EnginePair
from ..values.plan import COPY_COLUMNS, ZERO_COLUMNS, Copies, Rearrange, TransferPlan, Zeros

__all__ = ["ConnectorRows", "DescriptorTable", "Read", "Unresolved", "rows_from_descriptors"]


def _ids(value: Any, n: int, names: tuple[str, ...], path: str) -> np.ndarray:
    if value is None:
        return np.arange(n, dtype=np.int64).reshape(n, 1)
    arr = np.asarray(value, dtype=np.int64)
    if arr.ndim == 1:
        arr = arr.reshape(-1, 1)
    if arr.shape != (n, len(names)):
        raise PlanError(path, f"ids of shape {arr.shape} for {n} rows named {names}", actual=arr.shape,
                        expected=(n, len(names)), fix="give one id (per id name) per row")
    return arr


def _columns(value: Any, names: tuple[str, ...], path: str) -> dict[str, np.ndarray]:
    arr = np.asarray(value if value is not None and len(value) else np.zeros((0, len(names))), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != len(names):
        raise PlanError(path, f"rows of shape {arr.shape}", actual=arr.shape, expected=f"(n, {len(names)}): {names}",
                        fix="one row per descriptor, columns in that order")
    return {c: arr[:, i].copy() for i, c in enumerate(names)}


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

    @classmethod
    def from_rows(cls, copies: Any = (), zeros: Any = (), *, copy_ids: Any = None, zero_ids: Any = None,
                  id_names: Sequence[str] = ("descriptor",), zero_id_names: Sequence[str] = ("zero",),
                  rearranges: Sequence[Rearrange] = ()) -> ConnectorRows:
        """Rows as ``(p_rank, p_region, p_offset, d_rank, d_region, d_offset, nbytes)`` and
        ``(d_rank, d_region, d_offset, nbytes)`` (sequences, arrays, or :class:`Copies` /
        :class:`Zeros`); ids default to the row numbers."""
        c = copies if isinstance(copies, Copies) else Copies(**_columns(copies, COPY_COLUMNS, "copies"))
        z = zeros if isinstance(zeros, Zeros) else Zeros(**_columns(zeros, ZERO_COLUMNS, "zeros"))
        names, znames = tuple(id_names), tuple(zero_id_names)
        return cls(c, z, _ids(copy_ids, len(c), names, "copy_ids"), _ids(zero_ids, len(z), znames, "zero_ids"),
                   names, znames, tuple(rearranges))

    @classmethod
    def from_plan(cls, plan: TransferPlan) -> ConnectorRows:
        """kvgeom's own plan as a connector's rows (ids: row numbers), to compare like with like."""
        return cls.from_rows(plan.copies, plan.zeros, id_names=("row",), zero_id_names=("zero row",),
                             rearranges=plan.rearranges)

    def label(self, row: int, *, zero: bool = False) -> str:
        names, ids = (self.zero_id_names, self.zero_ids) if zero else (self.id_names, self.copy_ids)
        return " ".join(f"{n} {int(v)}" for n, v in zip(names, ids[row]))


@attrs.frozen(eq=False)
class DescriptorTable:
    """One NIXL descriptor list (vLLM's dlist): descriptor id ``i`` is ``addresses[i], lengths[i]``."""

    addresses: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64).reshape(-1))
    lengths: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64).reshape(-1))

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
        arr = np.asarray(descs, dtype=np.int64)
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

    d_rank: int
    p_rank: int
    local: DescriptorTable
    local_ids: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64).reshape(-1))
    remote: DescriptorTable
    remote_ids: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64).reshape(-1))


@attrs.frozen
class Unresolved:
    """A descriptor whose bytes lie in no registered region of its rank (it cannot be simulated)."""

    side: str
    rank: int
    address: int
    nbytes: int
    label: str


def _resolve(bases: np.ndarray, sizes: np.ndarray, addr: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(region, offset) of each ``[addr, addr + n)`` inside one region, region -1 when none holds it."""
    region = np.full(addr.size, -1, np.int64)
    offset = np.zeros(addr.size, np.int64)
    for r in range(bases.size):
        inside = (region < 0) & (addr >= bases[r]) & (addr + n <= bases[r] + sizes[r])
        region[inside] = r
        offset[inside] = addr[inside] - bases[r]
    return region, offset


def _bases(value: Any, ranks: int, nregions: int, path: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.int64)
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
    pair: EnginePair,
    *,
    prefill_bases: Any,
    decode_bases: Any,
    reads: Sequence[Read],
    zeros: Sequence[tuple[int, int, int]] = (),
) -> tuple[ConnectorRows, tuple[Unresolved, ...]]:
    """vLLM-style READs and zero ranges as :class:`ConnectorRows` (ids: read, local id, remote id).

    ``*_bases[rank][region]`` is the address of each region of each rank. ``zeros`` are
    ``(d_rank, address, nbytes)``. Descriptor pairs of different lengths, ids outside their tables
    and ranks outside the engines raise :class:`~kvgeom.errors.PlanError` (NIXL would refuse them);
    bytes outside every region are returned as :class:`Unresolved` (the report lists them).
    """
    P, D = pair.prefill, pair.decode
    pb = _bases(prefill_bases, P.num_ranks, len(P.regions), "prefill_bases")
    db = _bases(decode_bases, D.num_ranks, len(D.regions), "decode_bases")
    cols: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    unresolved: list[Unresolved] = []
    for k, rd in enumerate(reads):
        path = f"reads[{k}]"
        d = check_int(f"{path}.d_rank", rd.d_rank, minimum=0, error=PlanError)
        p = check_int(f"{path}.p_rank", rd.p_rank, minimum=0, error=PlanError)
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
        dreg, doff = _resolve(db[d], _held_sizes(D, d), la, ll)
        preg, poff = _resolve(pb[p], _held_sizes(P, p), ra, rl)
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
    zcols: list[list[int]] = []
    zids: list[int] = []
    for k, (d, addr, n) in enumerate(zeros):
        d = check_int(f"zeros[{k}].d_rank", d, minimum=0, error=PlanError)
        n = check_int(f"zeros[{k}].nbytes", n, minimum=1, error=PlanError)
        if d >= D.num_ranks:
            raise PlanError(f"zeros[{k}].d_rank", f"rank {d} outside {_outside(D.num_ranks, D.tp)}", actual=d,
                            expected=f"< {D.num_ranks}")
        reg, off = _resolve(db[d], _held_sizes(D, d), np.array([addr], np.int64), np.array([n], np.int64))
        if reg[0] < 0:
            unresolved.append(Unresolved("decode", d, int(addr), n, f"zero {k}"))
            continue
        zcols.append([d, int(reg[0]), int(off[0]), n])
        zids.append(k)
    copies = np.concatenate(cols) if cols else np.zeros((0, 7), np.int64)
    copy_ids = np.concatenate(ids) if ids else np.zeros((0, 3), np.int64)
    rows = ConnectorRows.from_rows(copies, np.asarray(zcols, np.int64).reshape(-1, 4), copy_ids=copy_ids,
                                   zero_ids=np.asarray(zids, np.int64), id_names=("read", "local", "remote"))
    return rows, tuple(unresolved)
