"""kvgeom.lowering.steps: zero rows, rearrange rows and strided runs cover exactly the bytes their
definitions name (checked against a brute-force enumeration, in numpy, without torch)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvgeom import PlanError, Rearrange, Zeros
from kvgeom.lowering import rearrange_rows, strided_runs, zero_rows


def _bytes(rows: np.ndarray, grain: int) -> list[int]:
    """The bytes ``grain``-byte rows stand for, in order."""
    return (rows[:, None] * grain + np.arange(grain)[None, :]).ravel().tolist()


def _random_zeros(rng: np.random.Generator, sizes: list[int]) -> Zeros:
    rows = []
    for _ in range(int(rng.integers(1, 12))):
        region = int(rng.integers(0, len(sizes)))
        grain = int(rng.choice([1, 8, 64, 256]))
        start = int(rng.integers(0, sizes[region] // grain)) * grain
        n = int(rng.integers(1, (sizes[region] - start) // grain + 1)) * grain
        rows.append((0, region, start, n))
    a = np.array(rows, np.int64)
    return Zeros(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def test_zero_rows_worked_number() -> None:
    # g = gcd(1024, 4096, 512, 256, 8192) = 256; rows 1024/256 = 4 (2 rows) and 4096/256 = 16 (1 row)
    z = zero_rows(Zeros([0, 0], [0, 0], [1024, 4096], [512, 256]), 0, 8192)
    assert z.grain == 256 and z.starts.tolist() == [4, 16] and z.counts.tolist() == [2, 1]
    assert z.index().tolist() == [4, 5, 16] and z.ends.tolist() == [1536, 4352]


@pytest.mark.parametrize("seed", range(30))
def test_zero_rows_cover_exactly_the_zeroed_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = [int(rng.choice([4096, 8192, 12288])) for _ in range(int(rng.integers(1, 4)))]
    zeros = _random_zeros(rng, sizes)
    for region, size in enumerate(sizes):
        z = zero_rows(zeros, region, size)
        want = [b for off, n, reg in zip(zeros.d_offset.tolist(), zeros.nbytes.tolist(), zeros.d_region.tolist())
                if reg == region for b in range(off, off + n)]
        assert size % z.grain == 0
        assert _bytes(z.index(), z.grain) == want


def test_zero_rows_refuse_a_row_past_the_region() -> None:
    with pytest.raises(PlanError, match="ends at byte 1280 of a 1024 B region"):
        zero_rows(Zeros([0], [0], [1024], [256]), 0, 1024)


def _random_rearrange(rng: np.random.Generator, page_bytes: int, num_pages: int, *, repeat: bool) -> Rearrange:
    while True:
        unit = int(rng.choice([1, 2, 4, 8, 16, 32]))
        shape = tuple(int(x) for x in rng.integers(1, 5, size=int(rng.integers(1, 4))))
        total = int(np.prod(shape)) * unit
        if total <= page_bytes:
            break

    def dense(order: np.ndarray) -> tuple[int, ...]:
        strides = [0] * len(shape)
        step = unit
        for ax in order[::-1]:
            strides[ax] = step
            step *= shape[ax]
        return tuple(strides)

    room = page_bytes - total
    pages = rng.choice(num_pages, size=int(rng.integers(1, num_pages + 1)), replace=repeat)
    return Rearrange(0, 0, tuple(int(p) for p in pages), shape, dense(rng.permutation(len(shape))),
                     dense(rng.permutation(len(shape))), unit, int(rng.integers(0, room + 1)),
                     int(rng.integers(0, room + 1)), page_bytes=page_bytes)


def _definition(r: Rearrange, pages: list[int], dst: bool) -> list[int]:
    """Rearrange's docstring, literally: page k, multi-index i -> k*page_bytes + offset + sum(i*strides)."""
    strides, offset = (r.dst_strides, r.dst_offset) if dst else (r.src_strides, r.src_offset)
    out = []
    for k in pages:
        for i in itertools.product(*(range(n) for n in r.shape)):
            start = k * r.page_bytes + offset + sum(a * s for a, s in zip(i, strides, strict=True))
            out += range(start, start + r.unit_bytes)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_rearrange_rows_are_the_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_bytes, num_pages = int(rng.choice([256, 512, 1024])), 6
    r = _random_rearrange(rng, page_bytes, num_pages, repeat=bool(seed % 2))
    rows = rearrange_rows(r, page_bytes * num_pages)
    assert (page_bytes * num_pages) % rows.grain == 0 and r.unit_bytes == rows.unit_rows * rows.grain
    assert _bytes(rows.src_index(), rows.grain) == _definition(r, list(r.pages), dst=False)
    assert _bytes(rows.dst_index(), rows.grain) == _definition(r, list(r.pages), dst=True)


@pytest.mark.parametrize("seed", range(40))
def test_strided_runs_are_the_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_bytes, num_pages = int(rng.choice([256, 512, 1024])), 6
    r = _random_rearrange(rng, page_bytes, num_pages, repeat=False)
    region = np.arange(page_bytes * num_pages, dtype=np.int64)  # each byte's own position
    runs = strided_runs(r, region.size)
    assert runs is not None and sum(run.size[0] for run in runs) == len(r.pages)

    def positions(size: tuple[int, ...], strides: tuple[int, ...], start: int) -> list[int]:
        view = np.lib.stride_tricks.as_strided(region[start:], size, tuple(s * region.itemsize for s in strides))
        return view.ravel().tolist()

    pages = sorted(r.pages)
    assert [b for run in runs for b in positions(run.size, run.src_strides, run.src_start)] == \
        _definition(r, pages, dst=False)
    assert [b for run in runs for b in positions(run.size, run.dst_strides, run.dst_start)] == \
        _definition(r, pages, dst=True)


def test_strided_runs_worked_number_and_repeats() -> None:
    # pages 3, 0, 1 -> runs (0, 2 pages) and (3, 1 page); the second starts at 3 * 64 = 192
    r = Rearrange(0, 0, (3, 0, 1), (2, 4), (8, 16), (32, 8), 8, page_bytes=64)
    runs = strided_runs(r, 256)
    assert runs is not None
    assert [(run.size, run.src_start, run.dst_start) for run in runs] == [((2, 2, 4, 8), 0, 0), ((1, 2, 4, 8), 192, 192)]
    assert runs[0].src_strides == (64, 8, 16, 1) and runs[0].dst_strides == (64, 32, 8, 1)
    assert strided_runs(Rearrange(0, 0, (1, 1), (2,), (8,), (16,), 8, page_bytes=64), 256) is None


def test_rearrange_past_the_region_is_refused() -> None:
    r = Rearrange(0, 0, (3,), (2,), (8,), (16,), 8, page_bytes=512)  # 3 * 512 + 16 + 8 = 1560
    with pytest.raises(PlanError, match="reach byte 1560 of a 1024 B region 0"):
        rearrange_rows(r, 1024)
    with pytest.raises(PlanError, match="reach byte 1560"):
        strided_runs(r, 1024)
