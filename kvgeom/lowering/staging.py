"""Pack and unpack steps lowered to strided views and index rows: the arithmetic an executor needs
to run a packed plan's steps as a few batched copies (the copies themselves, in torch, are the
executor's; docs/design.md §12.1 defines the steps).

A step applies one pattern to every (layer entry, page entry). Page entries whose page ids step by
one and whose staging offsets step by one constant form a *run*, and a run of one layer entry is
one pair of strided views::

    cache    as_strided((count, *shape, unit), (page_bytes, *cache_strides, 1),
                        pages[k] * page_bytes + offsets[l])                       (a region's bytes)
    staging  as_strided((count, *shape, unit), (page_staged step, *staging_strides, 1),
                        staged[l] + page_staged[k])                               (a slot's bytes)

Scattered pages (more runs than :data:`MAX_STAGED_RUNS`) use index rows instead: the region and
the slot are cut into rows of ``grain`` bytes (the gcd of every offset, stride and size involved),
and element ``e`` of page entry ``k`` of layer entry ``l`` covers rows::

    cache    (pages[k] * page_bytes + offsets[l] + cache_offset[e]) / grain + u,    u < unit / grain
    staging  (page_staged[k] + staged[l] + staging_offset[e]) / grain + u

Every function first checks that the step stays inside the region and the slot (a plan from a
peer is untrusted, docs/design.md §8).

Worked number: 12 consecutive D pages of 8192 B unpacked whole from a dense block are one run per
layer entry: ``size (12, 8192)``, cache strides ``(8192, 1)``, staging strides ``(8192, 1)``, one
contiguous copy of 98,304 B; the same pages scattered are 12 runs, past 16 the index form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce

import attrs
import numpy as np

from ..arith.runs import affine_runs
from ..errors import PlanError
from ..values.staging import StagingStep

__all__ = ["MAX_STAGED_RUNS", "StagedRun", "staged_runs", "StagedRows", "staged_rows", "check_step"]

MAX_STAGED_RUNS = 16
"""Up to this many runs per layer entry, a step is strided copies; beyond it, index rows."""


def check_step(step: StagingStep, region_bytes: Sequence[int], slot_bytes: int) -> None:
    """Raise :class:`PlanError` unless every element of ``step`` lies inside its region (of
    ``region_bytes``) and inside a slot of ``slot_bytes``."""
    if not (len(step.regions) and len(step.pages)):
        return
    if int(step.regions.max()) >= len(region_bytes):
        raise PlanError("StagingStep.regions", f"region {int(step.regions.max())} of {len(region_bytes)}",
                        actual=int(step.regions.max()), expected=f"< {len(region_bytes)}")
    span = sum((n - 1) * s for n, s in zip(step.shape, step.cache_strides)) + step.unit_bytes
    sizes = np.asarray(region_bytes, np.int64)[step.regions]
    end = int(step.pages.max()) * step.page_bytes + step.offsets + span
    if np.any(end > sizes):
        i = int(np.argmax(end > sizes))
        raise PlanError("StagingStep", f"layer entry {i} reaches byte {int(end[i])} of a {int(sizes[i])} B region",
                        actual=int(end[i]), expected=f"<= {int(sizes[i])}")
    hi = step.staging_span()[1]
    if hi > slot_bytes:
        raise PlanError("StagingStep", f"staging bytes reach {hi} of a {slot_bytes} B slot", actual=hi,
                        expected=f"<= {slot_bytes}", fix="plan with a staging_bytes the endpoints' slots hold")


@attrs.frozen
class StagedRun:
    """Page entries ``first .. first + count - 1`` of one layer entry as two strided byte views."""

    layer: int  # layer entry
    region: int  # cache region
    size: tuple[int, ...]  # (count, *shape, unit_bytes)
    cache_strides: tuple[int, ...]  # (page_bytes, *cache_strides, 1)
    cache_start: int
    staging_strides: tuple[int, ...]  # (staging step, *staging_strides, 1)
    staging_start: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.size, dtype=np.int64))


def staged_runs(step: StagingStep, region_bytes: Sequence[int], slot_bytes: int,
                max_runs: int = MAX_STAGED_RUNS) -> tuple[StagedRun, ...] | None:
    """Every layer entry's runs of ``step`` (see the module docstring), or ``None`` when the page
    entries split into more than ``max_runs`` runs (then use :func:`staged_rows`).

    >>> from kvgeom.values.staging import StagingStep
    >>> st = StagingStep("decode", 0, 0, 0, [0], [0], [0], [4, 5, 6], [0, 8192, 16384], 8192, (), (), (), 8192)
    >>> [(r.size, r.cache_start, r.staging_strides) for r in staged_runs(st, [65536], 24576)]
    [((3, 8192), 32768, (8192, 1))]
    """
    check_step(step, region_bytes, slot_bytes)
    first, count = affine_runs(step.pages, step.page_staged, 1)
    if len(first) > max_runs:
        return None
    out = []
    for lam in range(len(step.regions)):
        for k, n in zip(first.tolist(), count.tolist(), strict=True):
            stride = int(step.page_staged[k + 1] - step.page_staged[k]) if n > 1 else 0
            out.append(StagedRun(lam, int(step.regions[lam]), (n, *step.shape, step.unit_bytes),
                                 (step.page_bytes, *step.cache_strides, 1),
                                 int(step.pages[k]) * step.page_bytes + int(step.offsets[lam]),
                                 (stride, *step.staging_strides, 1),
                                 int(step.staged[lam]) + int(step.page_staged[k])))
    return tuple(out)


@attrs.frozen(eq=False)
class StagedRows:
    """One step in rows of ``grain`` bytes: add a layer entry's ``offsets`` / ``staged`` row to the
    page and element rows to get every row (the device expands them; :meth:`cache_index` and
    :meth:`staging_index` are the host form)."""

    grain: int
    regions: np.ndarray  # cache region of each layer entry
    offsets: np.ndarray  # offsets // grain
    staged: np.ndarray  # staged // grain
    pages: np.ndarray  # pages * page_bytes // grain
    page_staged: np.ndarray  # page_staged // grain
    cache_elements: np.ndarray  # pattern cache offsets // grain
    staging_elements: np.ndarray  # pattern staging offsets // grain
    unit_rows: int

    def _index(self, base: int, pages: np.ndarray, elements: np.ndarray) -> np.ndarray:
        u = np.arange(self.unit_rows, dtype=np.int64)
        return (base + pages[:, None, None] + elements[None, :, None] + u[None, None, :]).reshape(-1)

    def cache_index(self, layer: int) -> np.ndarray:
        """Every cache row of layer entry ``layer``: page entry, then element, then unit row."""
        return self._index(int(self.offsets[layer]), self.pages, self.cache_elements)

    def staging_index(self, layer: int) -> np.ndarray:
        """Every slot row of layer entry ``layer``, in the order of :meth:`cache_index`."""
        return self._index(int(self.staged[layer]), self.page_staged, self.staging_elements)


def staged_rows(step: StagingStep, region_bytes: Sequence[int], slot_bytes: int) -> StagedRows:
    """``step`` as rows of ``grain`` bytes (``grain`` also divides ``slot_bytes`` and every region, so
    both can be viewed as rows).

    >>> from kvgeom.values.staging import StagingStep
    >>> st = StagingStep("prefill", 0, 0, 0, [0], [0], [0], [3, 1], [0, 512], 1024, (2,), (256,), (1024,), 256)
    >>> r = staged_rows(st, [4096], 2048)
    >>> r.grain, r.cache_index(0).tolist(), r.staging_index(0).tolist()
    (256, [12, 13, 4, 5], [0, 4, 2, 6])
    """
    check_step(step, region_bytes, slot_bytes)
    cache, staging = step.pattern_offsets()
    parts = [step.unit_bytes, step.page_bytes, slot_bytes, *region_bytes]
    for arr in (cache, staging, step.offsets, step.staged, step.page_staged):
        if arr.size:
            parts.append(int(np.gcd.reduce(arr)))
    g = reduce(math.gcd, parts)
    return StagedRows(g, step.regions, step.offsets // g, step.staged // g, step.pages * (step.page_bytes // g),
                      step.page_staged // g, cache // g, staging // g, step.unit_bytes // g)
