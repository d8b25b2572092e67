"""Property tests of the two small folding functions: ``coalesce`` and ``strided_rows``."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgeom import Copies, Zeros, coalesce, coalesce_zeros
from kvgeom.arith import fold_modes, strided_rows


def byte_map(c: Copies) -> set[tuple[int, int, int, int, int, int]]:
    out = set()
    for pr, pg, po, dr, dg, do, n in c.as_array().tolist():
        for i in range(n):
            out.add((pr, pg, po + i, dr, dg, do + i))
    return out


def mergeable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return a[:2] == b[:2] and a[3:5] == b[3:5] and a[2] + a[6] == b[2] and a[5] + a[6] == b[5]


@st.composite
def copy_sets(draw: st.DrawFn) -> Copies:
    """Copies cut from a few random byte-to-byte maps: disjoint D ranges per (rank, region)."""
    rows = []
    for d_rank, d_region in draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1,
                                          max_size=3, unique=True)):
        p_rank, p_region = draw(st.integers(0, 1)), draw(st.integers(0, 1))
        d_at = 0
        for _ in range(draw(st.integers(1, 8))):
            d_at += draw(st.integers(0, 3))  # gaps on D
            n = draw(st.integers(1, 5))
            p_at = draw(st.sampled_from([d_at, d_at + 100, 7 * d_at]))  # adjacent on P or not
            rows.append((p_rank, p_region, p_at, d_rank, d_region, d_at, n))
            d_at += n
    order = draw(st.permutations(range(len(rows))))
    cols = np.array([rows[i] for i in order], np.int64).T
    return Copies(*cols)


@settings(max_examples=200, deadline=None)
@given(copy_sets())
def test_coalesce_keeps_the_byte_map_and_leaves_nothing_mergeable(c: Copies) -> None:
    out = coalesce(c)
    assert byte_map(out) == byte_map(c)
    assert len(out) <= len(c)
    rows = [tuple(r) for r in out.as_array().tolist()]
    for a, b in itertools.permutations(rows, 2):
        assert not mergeable(a, b)


def test_coalesce_merges_a_chain_written_by_hand() -> None:
    # P [0,4)->D [8,12), P [4,8)->D [12,16), P [8,9)->D [16,17): one row P [0,9) -> D [8,17)
    c = Copies([0, 0, 0], [0, 0, 0], [4, 0, 8], [0, 0, 0], [0, 0, 0], [12, 8, 16], [4, 4, 1])
    assert coalesce(c).as_array().tolist() == [[0, 0, 0, 0, 0, 8, 9]]
    # adjacent on D but not on P: stays two rows
    c2 = Copies([0, 0], [0, 0], [0, 100], [0, 0], [0, 0], [0, 4], [4, 4])
    assert len(coalesce(c2)) == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 40), st.integers(1, 6)), max_size=12))
def test_coalesce_zeros_covers_the_same_bytes_with_no_touching_rows(spec: list[tuple[int, int, int]]) -> None:
    # make non-overlapping rows per rank by laying them out left to right
    rows, at = [], {0: 0, 1: 0}
    for rank, gap, n in spec:
        at[rank] += gap % 3
        rows.append((rank, 0, at[rank], n))
        at[rank] += n
    z = Zeros(*np.array(rows, np.int64).reshape(-1, 4).T) if rows else Zeros.empty()
    out = coalesce_zeros(z)
    before = {(r, o + i) for r, _, o, n in rows for i in range(n)}
    after = {(r, o + i) for r, _, o, n in out.as_array().tolist() for i in range(n)}
    assert before == after
    arr = out.as_array().tolist()
    for a, b in zip(arr, arr[1:]):
        assert not (a[0] == b[0] and a[2] + a[3] == b[2])


modes_st = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 64), st.integers(0, 64)), max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), modes_st, st.integers(0, 50), st.integers(0, 50))
def test_strided_rows_enumerates_exactly_the_strided_block(unit: int, modes: list[tuple[int, int, int]],
                                                           base_p: int, base_d: int) -> None:
    """Every (index, byte) of the block appears once, at the same place on both sides."""
    m = [(size, (sp, sd)) for size, sp, sd in modes]
    (op, od), run, per = strided_rows(unit, m, [np.array([base_p]), np.array([base_d])])
    got = sorted((int(p) + i, int(d) + i) for p, d in zip(op, od) for i in range(run))
    want = []
    for idx in itertools.product(*[range(size) for size, _, _ in modes]):
        p = base_p + sum(i * sp for i, (_, sp, _) in zip(idx, modes))
        d = base_d + sum(i * sd for i, (_, _, sd) in zip(idx, modes))
        want.extend((p + b, d + b) for b in range(unit))
    assert got == sorted(want)
    assert per == len(op)


def test_fold_modes_worked_example() -> None:
    # HND P page (token stride 256, head stride 4096) into an NHD D page (512, 256), 256 B heads
    run, rest = fold_modes(256, [(16, (256, 512)), (2, (4096, 256))])
    assert run == 256 and rest == [(16, (256, 512)), (2, (4096, 256))]
    # both HND: tokens then heads fold into one 2 * 16 * 256 B run
    run, rest = fold_modes(256, [(16, (256, 256)), (2, (4096, 4096))])
    assert run == 2 * 16 * 256 and rest == []
