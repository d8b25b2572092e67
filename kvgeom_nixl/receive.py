"""Receive-side steps with torch: a plan's rearranges, then its zeros, on the cache's device.

Both work on a flat ``uint8`` view of each D region, in a few ops per region whatever the row
count. Every offset, granularity and index comes from :mod:`kvgeom.lowering.steps`; this module only
turns them into torch ops::

    zeros:      up to 64 rows in a region: view[offset:end].zero_() per row (whole blocks: a memset each)
                more rows: rows = zero_rows(zeros, region, size)   (grain g, starts, counts)
                           view.view(-1, g)[expand(starts, counts)] = 0
    rearrange:  pages in a few runs of consecutive ids: strided_runs(r, size), per run
                  src = view.as_strided(run.size, run.src_strides, run.src_start); tmp = src.clone()
                  view.as_strided(run.size, run.dst_strides, run.dst_start).copy_(tmp)
                scattered pages: rows = rearrange_rows(r, size)     (grain g, page/element/unit rows)
                  tmp = view.view(-1, g).index_select(0, page + src + u); view.view(-1, g)[page + dst + u] = tmp

Only the compact inputs (per-row starts and counts, a rearrange's page and element rows) go from
host to device, through pinned memory with ``non_blocking=True``; the per-row expansion happens on
the device (:func:`kvgeom.arith.run_bases` then ``repeat_interleave`` with a known ``output_size``,
so no device sync). On CUDA the ops run on the given stream and an event marks their end; on CPU
they run in place immediately, with the index expanded by numpy (:func:`kvgeom.arith.run_offsets`;
no copy to make: host memory is the device). This is the receive part of docs/design.md §8.

Worked number: zeroing rows (1024, 512) and (4096, 256) of an 8192-byte region takes two
``zero_()`` slices; past 64 rows it would be one index op over g = 256-byte rows [4, 5, 16].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvgeom import PlanError, Rearrange, Zeros
from kvgeom.arith import run_bases
from kvgeom.lowering import StridedRun, ZeroRows, rearrange_rows, strided_runs, zero_rows

from .staging import host_copies

__all__ = ["apply_zeros", "apply_rearranges", "apply_receive_steps"]


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _zero_index(rows: ZeroRows, device: torch.device) -> torch.Tensor:
    """Every ``grain``-byte row of ``rows``, expanded where the cache lives."""
    if device.type == "cpu":  # host memory: numpy expands in place (torch's CPU repeat_interleave is ~8 ms a call)
        return torch.from_numpy(rows.index())
    base, total = run_bases(rows.starts, rows.counts)
    counts = _to_device(rows.counts, device)
    return (torch.repeat_interleave(_to_device(base, device), counts, output_size=total)
            + torch.arange(total, device=device, dtype=torch.int64))


def _check_view(view: Any, region: int) -> torch.Tensor:
    if view is None:
        raise PlanError(f"d_region {region}", "receive steps need a tensor view of the region (registered from a raw "
                        "VRAM pointer, or a region of another pipeline stage that this rank does not hold)",
                        fix="register that region from a torch tensor; plan for this rank's own regions")
    return view  # type: ignore[no-any-return]


MAX_SLICED_ROWS = 64
"""Up to this many zero rows in a region, each row is one slice ``zero_()`` (a memset); beyond it,
one batched index op zeroes them all."""


def apply_zeros(views: Sequence[Any], zeros: Zeros) -> None:
    """Zero every row of ``zeros`` (one D rank's rows) in ``views[region]``: a memset per row when
    there are few (whole blocks), one batched index op per region when there are many (tails)."""
    if not len(zeros):
        return
    with host_copies(_device(views)):  # one torch thread for host copies (kvgeom_nixl.staging)
        _apply_zeros(views, zeros)


def _device(views: Sequence[Any]) -> torch.device:
    return next((v.device for v in views if v is not None), torch.device("cpu"))


def _apply_zeros(views: Sequence[Any], zeros: Zeros) -> None:
    for region in np.unique(zeros.d_region).tolist():
        view = _check_view(views[region], region)
        rows = zero_rows(zeros, region, int(view.numel()))  # raises PlanError for a row past the region
        if len(rows.offset) <= MAX_SLICED_ROWS:
            for a, b in zip(rows.offset.tolist(), rows.ends.tolist(), strict=True):
                view[a:b].zero_()
            continue
        view.view(-1, rows.grain)[_zero_index(rows, view.device)] = 0  # index_put_: ~2x index_fill_ on CPU


MAX_STRIDED_RUNS = 16
"""Up to this many runs of consecutive pages, a rearrange is a few strided copies; beyond it, one
batched gather/scatter over an index of every unit (scattered pages)."""


def _strided(view: torch.Tensor, size: tuple[int, ...], strides: tuple[int, ...], start: int) -> torch.Tensor:
    return view.as_strided(size, strides, view.storage_offset() + start)


def _move_runs(view: torch.Tensor, runs: Sequence[StridedRun]) -> None:
    """Read every run, then write every run (one ``clone`` and one ``copy_`` per run)."""
    read = [_strided(view, run.size, run.src_strides, run.src_start).clone() for run in runs]
    for run, values in zip(runs, read, strict=True):
        _strided(view, run.size, run.dst_strides, run.dst_start).copy_(values)


def _element_rows(pages: np.ndarray, elems: np.ndarray, unit_rows: int, device: torch.device) -> torch.Tensor:
    """``page + element + u`` for every page, element and unit row, expanded on the device (the
    device form of :meth:`kvgeom.lowering.RearrangeRows.src_index`)."""
    p = _to_device(pages, device)
    e = _to_device(elems, device)
    u = torch.arange(unit_rows, device=device, dtype=torch.int64)
    return (p[:, None, None] + e[None, :, None] + u[None, None, :]).reshape(-1)


def apply_rearranges(views: Sequence[Any], rearranges: Sequence[Rearrange]) -> None:
    """Apply each rearrange (read all its elements of all its pages, then write them), in order.

    Pages in a few runs of consecutive ids (fresh allocations) move as strided views, one
    ``clone`` (the read) and one ``copy_`` (the write) per run; scattered pages move with one
    index_select / index_put over every unit of every page.
    """
    with host_copies(_device(views)):  # one torch thread for host copies (kvgeom_nixl.staging)
        _apply_rearranges(views, rearranges)


def _apply_rearranges(views: Sequence[Any], rearranges: Sequence[Rearrange]) -> None:
    for r in rearranges:
        if not r.pages:
            continue
        view = _check_view(views[r.d_region], r.d_region)
        size = int(view.numel())
        runs = strided_runs(r, size)  # raises PlanError for an element past the region
        if runs is not None and len(runs) <= MAX_STRIDED_RUNS:
            _move_runs(view, runs)
            continue
        rows = rearrange_rows(r, size)
        grid = view.view(-1, rows.grain)
        values = grid.index_select(0, _element_rows(rows.pages, rows.src, rows.unit_rows, view.device))
        grid[_element_rows(rows.pages, rows.dst, rows.unit_rows, view.device)] = values


def apply_receive_steps(views: Sequence[Any], rearranges: Sequence[Rearrange], zeros: Zeros, *,
                        stream: Any = None) -> Any:
    """Rearranges then zeros (the plan's order). On CUDA, run on ``stream`` and return an event
    recorded after the last op; on CPU return ``None`` (done)."""
    if not rearranges and not len(zeros):
        return None
    if stream is None:
        apply_rearranges(views, rearranges)
        apply_zeros(views, zeros)
        return None
    with torch.cuda.stream(stream):
        apply_rearranges(views, rearranges)
        apply_zeros(views, zeros)
        event = torch.cuda.Event()
        event.record(stream)
    return event
