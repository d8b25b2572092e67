"""Pull recipes (kvgeom_nixl/vllm/recipes.py, docs/design.md §15.4): a request of a shape seen before
posts the learnt rows shifted by its block ids, with no planning.

The oracle is kvgeom's planner (itself checked against the simulator): for every shifted request
the recipe's rows, consumers and writable blocks must equal what ``plan_pair`` gives for that
request, read off the plan's columns here. Then through the executor on NIXL: repeated pulls of one
shape from ids elsewhere each time land every byte where CPU_ATTN's address formula says
(tests/test_vllm_e2e_units.py's checker), and a control with the D shift dropped fails that check.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    BlockList,
    CostModel,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    PlanBudget,
    Request,
    TransferPlan,
    request_from_block_tables,
)
from kvgeom.planning import plan_pair
from kvgeom_nixl.vllm import recipes
from kvgeom_nixl.vllm.recipes import PullRecipes

STRATEGY = "auto"


class PlanningLink:
    """What :class:`PullRecipes` uses of a link: its pair and ``plan`` (the connector's call)."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.plans = 0

    def plan(self, request: Request, *, strategy: str, cost_model: CostModel | None = None) -> TransferPlan:
        self.plans += 1
        return plan_pair(self.pair, request, strategy=strategy, staging_bytes=0,  # type: ignore[arg-type]
                         budget=PlanBudget(), cost_model=cost_model or CostModel())


def engines(p_block: int, p_tp: int, d_block: int, d_tp: int, **kw: Any) -> Pair:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 3, 4, 64)])
    return Pair(EngineGeometry.build(m, tp=p_tp, kernel_block_tokens=p_block, num_blocks=96, name="P", **kw),
                EngineGeometry.build(m, tp=d_tp, kernel_block_tokens=d_block, num_blocks=96, name="D", **kw))


def table(pair: Pair, m: int, s: int, p0: int, d0: int, p_rel: tuple[int, ...], d_rel: tuple[int, ...]) -> Request:
    return request_from_block_tables(pair, m, [tuple(p0 + x for x in p_rel)], [tuple(d0 + x for x in d_rel)],
                                     prefix_hit_tokens=s, null_block=0)


def planned(pair: Pair, request: Request, rank: int) -> tuple[dict[int, list[np.ndarray]], dict[int, int], dict]:
    """From the planner: this D rank's copies per P rank (d_region, d_offset, p_region, p_offset,
    nbytes, in plan order), the D ranks reading each of those P ranks, D's writable blocks."""
    plan = plan_pair(pair, request, strategy=STRATEGY, staging_bytes=0, budget=PlanBudget())  # type: ignore[arg-type]
    c = plan.copies
    mine = c.d_rank == rank
    rows = {int(p): [np.asarray(col[mine & (c.p_rank == p)], dtype=np.int64)
                     for col in (c.d_region, c.d_offset, c.p_region, c.p_offset, c.nbytes)]
            for p in np.unique(c.p_rank[mine])}
    consumers = {p: len(np.unique(c.d_rank[c.p_rank == p])) for p in rows}
    return rows, consumers, pair.writable_blocks(request)


def learn(book: PullRecipes, pair: Pair, rank: int, m: int, s: int, p0: int, d0: int, p_rel: tuple[int, ...],
          d_rel: tuple[int, ...]) -> None:
    """What the executor does after a planned pull of this request."""
    request = table(pair, m, s, p0, d0, p_rel, d_rel)
    rows, consumers, writable = planned(pair, request, rank)
    shape = book.shape(m, s, m, [tuple(p0 + x for x in p_rel)], [tuple(d0 + x for x in d_rel)])
    assert shape is not None
    plan = plan_pair(pair, request, strategy=STRATEGY, staging_bytes=0, budget=PlanBudget())  # type: ignore[arg-type]
    book.learn(shape, request, plan, consumers, writable)


def assert_applies_as_planned(book: PullRecipes, pair: Pair, rank: int, m: int, s: int, p0: int, d0: int,
                              p_rel: tuple[int, ...], d_rel: tuple[int, ...]) -> None:
    shape = book.shape(m, s, m, [tuple(p0 + x for x in p_rel)], [tuple(d0 + x for x in d_rel)])
    assert shape is not None
    got = book.apply(shape)
    assert got is not None, (p0, d0)
    rows, consumers, writable = planned(pair, table(pair, m, s, p0, d0, p_rel, d_rel), rank)
    assert sorted(got.reads) == sorted(rows), (p0, d0)
    for p in rows:
        for name, a, b in zip(("d_region", "d_offset", "p_region", "p_offset", "nbytes"), got.reads[p], rows[p]):
            assert np.array_equal(a, b), (p0, d0, p, name)
    assert got.consumers == consumers and got.invalid_blocks == writable, (p0, d0)


# (P block, P TP, D block, D TP, builder options)
CELLS = [
    (16, 1, 16, 1, {}),
    (16, 1, 32, 2, {}),
    (32, 2, 16, 1, {"layout": "NHD"}),
    (16, 2, 16, 4, {"layout": "NHD", "kv": "split", "regions": "interleaved"}),
    (32, 1, 32, 1, {"layout": "CPU_ATTN"}),
    (32, 1, 64, 2, {"layout": "CPU_ATTN"}),
    (16, 1, 16, 1, {"regions": "shared"}),
]
# (M, S, P's ids, D's ids) relative to each list's first id: fresh, off a block boundary, a prefix
# hit, scattered lists
SCENARIOS = [
    (128, 0, tuple(range(8)), tuple(range(8))),
    (100, 0, tuple(range(7)), tuple(range(7))),
    (96, 64, tuple(range(6)), (0, 1)),
    (64, 0, (0, 2, 3, 7), (5, 1, 0, 9)),
]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}x{c[3]}-{'-'.join(c[4].values())}")
@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
def test_a_recipe_gives_the_planners_rows_for_every_shift(cell: tuple[Any, ...], scenario: int) -> None:
    p_block, p_tp, d_block, d_tp, kw = cell
    m, s, p_rel, d_rel = SCENARIOS[scenario]
    pair = engines(p_block, p_tp, d_block, d_tp, **kw)
    per_p, per_d = pair.prefill.logical_block_tokens, pair.decode.logical_block_tokens
    p_rel, d_rel = p_rel[:-(-m // per_p)], d_rel[:-(-m // per_d) - s // per_d]  # the lists the blocks need
    plan = plan_pair(pair, table(pair, m, s, 3, 40, p_rel, d_rel), strategy=STRATEGY, staging_bytes=0,
                     budget=PlanBudget())
    for rank in range(d_tp):
        book = PullRecipes(PlanningLink(pair), STRATEGY, rank)  # type: ignore[arg-type]
        learn(book, pair, rank, m, s, 3, 40, p_rel, d_rel)
        learn(book, pair, rank, m, s, 20, 2, p_rel, d_rel)
        part = plan.for_decode_rank(rank)
        if plan.packed or len(part.zeros) or part.rearranges:  # receive steps: planned every time
            assert book.counts == {"refused": 1}, book.counts
            shape = book.shape(m, s, m, [tuple(50 + x for x in p_rel)], [tuple(7 + x for x in d_rel)])
            assert shape is not None and book.apply(shape) is None
            continue
        assert book.counts["learnt"] == 1, book.counts
        LEARNT.add((cell[:4], scenario))
        for p0, d0 in [(1, 1), (3, 40), (50, 7), (70, 70), (1, 80)]:
            assert_applies_as_planned(book, pair, rank, m, s, p0, d0, p_rel, d_rel)


LEARNT: set[Any] = set()


def test_most_cells_are_learnt() -> None:
    """The test above is not vacuous: it ran first (pytest keeps file order) and learnt most cells."""
    assert len(LEARNT) >= 10 and ((32, 1, 32, 1), 0) in LEARNT and ((16, 2, 16, 4), 3) in LEARNT, sorted(LEARNT)


def test_the_check_catches_a_wrong_shift(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: rows shifted on one side only are not the planner's (the comparison above fails)."""
    pair = engines(16, 2, 16, 4, layout="NHD", kv="split", regions="interleaved")
    p_rel, d_rel = tuple(range(8)), tuple(range(8))
    book = PullRecipes(PlanningLink(pair), STRATEGY, 1)  # type: ignore[arg-type]
    learn(book, pair, 1, 128, 0, 3, 40, p_rel, d_rel)
    learn(book, pair, 1, 128, 0, 20, 2, p_rel, d_rel)
    shifted = recipes._shifted
    monkeypatch.setattr(recipes, "_shifted", lambda r, dp, dd: shifted(r, dp, 0))
    with pytest.raises(AssertionError):
        assert_applies_as_planned(book, pair, 1, 128, 0, 50, 7, p_rel, d_rel)
    assert_applies_as_planned(book, pair, 1, 128, 0, 50, 2, p_rel, d_rel)  # (D ids where learnt: still right)


def test_a_shape_is_learnt_on_its_second_request_and_probed_twice() -> None:
    pair = engines(16, 1, 16, 1)
    link = PlanningLink(pair)
    book = PullRecipes(link, STRATEGY, 0)  # type: ignore[arg-type]
    rel = tuple(range(4))
    learn(book, pair, 0, 64, 0, 3, 5, rel, rel)
    assert link.plans == 0 and book.counts == {"seen": 1}
    shape = book.shape(64, 0, 64, [tuple(30 + x for x in rel)], [tuple(30 + x for x in rel)])
    assert shape is not None and book.apply(shape) is None  # seen once: planned again
    learn(book, pair, 0, 64, 0, 9, 9, rel, rel)
    assert link.plans == 2 and book.counts["learnt"] == 1  # the two probes (P ids + 1, D ids + 1)
    assert book.apply(shape) is not None


def test_what_a_recipe_does_not_cover_is_planned() -> None:
    pair = engines(16, 1, 16, 1)
    book = PullRecipes(PlanningLink(pair), STRATEGY, 0)  # type: ignore[arg-type]
    rel = tuple(range(4))
    learn(book, pair, 0, 64, 0, 3, 5, rel, rel)
    learn(book, pair, 0, 64, 0, 9, 9, rel, rel)

    def shape(p: Any, d: Any, m: int = 64) -> Any:
        return book.shape(m, 0, m, [p], [d])

    assert book.apply(shape(tuple(10 + x for x in rel), tuple(20 + x for x in rel))) is not None
    assert shape((3, 4, 5, 6.0), (1, 2, 3, 4)) is None  # not all ints: the planner names the field
    assert shape((3, 4, 5, True), (1, 2, 3, 4)) is None
    assert book.apply(shape((3, 4, 6, 7), (1, 2, 3, 4))) is None  # another relative pattern
    assert book.apply(shape((3, 4, 5, 6), (1, 2, 3, 4), m=60)) is None  # another token count
    assert book.apply(shape((0, 1, 2, 3), (1, 2, 3, 4))) is None  # id 0 (vLLM's null block)
    assert book.apply(shape((92, 93, 94, 95), (1, 2, 3, 4))) is not None  # id 95: the last of 96 blocks
    assert book.apply(shape((93, 94, 95, 96), (1, 2, 3, 4))) is None  # past P's pool (hostile ids)
    assert book.apply(shape((1, 2, 3, 4), (93, 94, 95, 96))) is None  # past D's
    assert book.apply(shape((10**12, 10**12 + 1, 10**12 + 2, 10**12 + 3), (1, 2, 3, 4))) is None


def test_a_recipe_that_does_not_reproduce_the_first_request_is_refused() -> None:
    pair = engines(16, 1, 16, 1)
    book = PullRecipes(PlanningLink(pair), STRATEGY, 0)  # type: ignore[arg-type]
    rel = tuple(range(4))
    request = table(pair, 64, 0, 3, 5, rel, rel)
    shape = book.shape(64, 0, 64, [tuple(3 + x for x in rel)], [tuple(5 + x for x in rel)])
    plan = plan_pair(pair, request, strategy=STRATEGY, staging_bytes=0, budget=PlanBudget())  # type: ignore[arg-type]
    assert shape is not None
    book.learn(shape, request, plan, {0: 1}, {0: (5, 6, 7, 99)})  # a first request's blocks that do not fit
    learn(book, pair, 0, 64, 0, 9, 9, rel, rel)
    assert book.counts["refused"] == 1 and book.apply(shape) is None
    learn(book, pair, 0, 64, 0, 20, 20, rel, rel)  # refused shapes stay planned
    assert book.counts["refused"] == 1 and book.apply(shape) is None


def test_state_groups_and_plans_with_receive_steps_are_planned_every_time() -> None:
    from kvgeom.building.presets import PRESETS

    hybrid, _ = PRESETS["nemotron-h-tp1-tp4"].build(layers=2)
    groups = len(hybrid.model.groups)
    assert any(not isinstance(g, AttentionSpec) for g in hybrid.model.groups)
    book = PullRecipes(PlanningLink(hybrid), STRATEGY, 0)  # type: ignore[arg-type]
    assert book.shape(64, 0, 64, [(1,)] * groups, [(1,)] * groups) is None
    # a partial last block on CPU_ATTN moves K rows one by one and zeroes D's rest: zeros, refused
    pair = engines(32, 1, 32, 1, layout="CPU_ATTN")
    book = PullRecipes(PlanningLink(pair), STRATEGY, 0)  # type: ignore[arg-type]
    rel = tuple(range(4))
    request = request_from_block_tables(pair, 100, [tuple(3 + x for x in rel)], [tuple(5 + x for x in rel)],
                                        decode_tokens=128)
    plan = plan_pair(pair, request, strategy=STRATEGY, staging_bytes=0, budget=PlanBudget())  # type: ignore[arg-type]
    shape = book.shape(100, 0, 128, [tuple(3 + x for x in rel)], [tuple(5 + x for x in rel)])
    assert shape is not None and len(plan.zeros)
    book.learn(shape, request, plan, {0: 1}, pair.writable_blocks(request))
    assert book.counts == {"refused": 1}


def test_probes_use_the_request_as_listed() -> None:
    """A probe moves one side's ids by one and keeps everything else (first tokens, S, and P's ids
    inside the hit: blocks 0-3 of 16 tokens for S = 64, which the pull never reads)."""
    pair = engines(16, 1, 16, 1)
    seen: list[Request] = []
    link = PlanningLink(pair)
    plan = link.plan

    def record(request: Request, *, strategy: str, cost_model: CostModel | None = None) -> TransferPlan:
        seen.append(request)
        return plan(request, strategy=strategy, cost_model=cost_model)

    link.plan = record  # type: ignore[method-assign]
    book = PullRecipes(link, STRATEGY, 0)  # type: ignore[arg-type]
    learn(book, pair, 0, 96, 64, 3, 5, tuple(range(6)), (0, 1))
    learn(book, pair, 0, 96, 64, 9, 9, tuple(range(6)), (0, 1))
    assert [r.groups[0] for r in seen] == [
        GroupRequest(BlockList((9, 10, 11, 12, 14, 15), 0), BlockList((9, 10), 64)),
        GroupRequest(BlockList(tuple(range(9, 15)), 0), BlockList((10, 11), 64))]
    assert all(r.prefix_hit_tokens == 64 and r.computed_tokens == 96 for r in seen)


# ---- through the executor, on NIXL ---------------------------------------------------------------


def _engines() -> Any:
    pytest.importorskip("torch")
    from nixl_env import NIXL_API

    pytest.importorskip(NIXL_API, reason="kvgeom_nixl needs the nixl extra")
    import test_vllm_e2e_units as units

    return units


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p_block, p_tp, d_block, d_tp", [(32, 1, 32, 1), (32, 1, 64, 2)])
def test_repeated_shapes_are_posted_from_their_recipe_byte_exact(p_block: int, p_tp: int, d_block: int,
                                                                 d_tp: int) -> None:
    """Four pulls of one shape (M = 128: whole blocks on both sides, vLLM's last token recomputed
    on D), each from P and D blocks elsewhere: the first two are planned, the last two posted from
    the recipe; every token lands where CPU_ATTN's formula says."""
    units = _engines()
    e = units.Engines(p_block, p_tp, d_block, d_tp)
    try:
        for i, (p0, d0) in enumerate([(2, 3), (9, 1), (14, 12), (5, 17)]):
            p_ids, d_ids = list(range(p0, p0 + 128 // p_block)), list(range(d0, d0 + 128 // d_block))
            e.pull(f"r{i}", 128, p_ids, d_ids, recomputed=1)
            d_out, p_out = e.wait()
            assert all(r.finished_recving == {f"d-r{i}"} and not r.failed for r in d_out), d_out
            units.assert_tokens_equal(e, range(128), p_ids, d_ids)
        for ex in e.d:
            assert ex._d_recipes["P"].counts == {"seen": 1, "learnt": 1, "applied": 2}
            assert ex.counters()["recipes applied"] == 2 and ex.pending()["pulls"] == 0
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_control_a_recipe_without_the_d_shift_puts_bytes_in_the_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte check above can fail: the recipe learnt, then applied with D's shift dropped."""
    units = _engines()
    shifted = recipes._shifted
    e = units.Engines(32, 1, 32, 1)
    try:
        for i, (p0, d0) in enumerate([(2, 3), (9, 1), (14, 12)]):
            if i == 2:  # (learnt on the first two: a recipe that fails its check is never kept)
                monkeypatch.setattr(recipes, "_shifted", lambda r, dp, dd: shifted(r, dp, 0))
            p_ids, d_ids = list(range(p0, p0 + 4)), list(range(d0, d0 + 4))
            e.pull(f"r{i}", 128, p_ids, d_ids, recomputed=1)
            e.wait()
        assert e.d[0]._d_recipes["P"].counts["applied"] == 1
        with pytest.raises(AssertionError, match="layer 0 token 0"):
            units.assert_tokens_equal(e, range(128), p_ids, d_ids)
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_post_pull_refuses_rows_outside_the_regions() -> None:
    """Rows past a region (a recipe gone wrong, or a caller's own) fail the transfer before posting."""
    from kvgeom_nixl.errors import ExecutorError

    units = _engines()
    e = units.Engines(32, 1, 32, 1)
    try:
        e.pull("r0", 128, [2, 3, 4, 5], [3, 4, 5, 6])
        e.wait()
        d = e.d[0]
        link = d._d_links["P"]
        size = int(link.endpoint.memory.sizes[0])
        ok = [np.array(v, dtype=np.int64) for v in ([0], [0], [0], [0], [4096])]
        for side, bad in (("d", 1), ("p", 3)):
            cols = list(ok)
            cols[bad] = np.array([size - 100], dtype=np.int64)
            with d.lock:
                t = link.post_pull(f"x{side}", {0: tuple(cols)}, consumers={0: 1}, invalid_blocks={0: (3,)},
                                   timeout_s=5.0)
            assert t.failure is not None and t.failure.reason == "plan_error", t.failure
            assert f"reads.{side}_offset[0]" in str(t.failure) and not t.posters
        with d.lock:
            t = link.post_pull("x-int32", {0: (ok[0].astype(np.int32), *ok[1:])}, consumers={0: 1},
                               invalid_blocks={}, timeout_s=5.0)
            assert t.failure is not None and "int64" in str(t.failure)
            with pytest.raises(ExecutorError, match="peer rank"):
                link.post_pull("x-rank", {1: tuple(ok)}, consumers={1: 1}, invalid_blocks={}, timeout_s=5.0)
    finally:
        e.close()


@pytest.mark.parametrize("cell", [CELLS[0], CELLS[3], CELLS[4]],  # (cells whose hit plans are copies only)
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}x{c[3]}-{'-'.join(c[4].values())}")
def test_p_ids_inside_the_hit_are_not_part_of_the_shape(cell: tuple[Any, ...]) -> None:
    """A prefix hit's P blocks before the first one past S are never read: requests that differ
    only there share a recipe, and its rows are the planner's for each of them (the planner sees
    every id). Control: the first P id past the hit moved gives another shape."""
    p_block, p_tp, d_block, d_tp, kw = cell
    pair = engines(p_block, p_tp, d_block, d_tp, **kw)
    per_p, per_d = pair.prefill.logical_block_tokens, pair.decode.logical_block_tokens
    s = 2 * per_d  # (a multiple of both block sizes)
    m = s + 2 * per_d  # (whole blocks: a partial one zeroes D's rest, and plans with zeros are not learnt)
    n_p = -(-m // per_p)
    skip = s // per_p
    d_rel = tuple(range(-(-m // per_d) - s // per_d))
    heads = [tuple(range(skip)), tuple(40 + 2 * i for i in range(skip))[::-1], tuple(70 + i for i in range(skip))]
    tail = tuple(range(20, 20 + n_p - skip))
    for rank in range(d_tp):
        book = PullRecipes(PlanningLink(pair), STRATEGY, rank)  # type: ignore[arg-type]
        for i, head in enumerate(heads[:2]):
            learn(book, pair, rank, m, s, 0, 3 + i, head + tail, d_rel)
        assert book.counts["learnt"] == 1, book.counts
        for head in heads:
            for dp, d0 in ((0, 1), (-15, 30), (5, 9)):
                p_rel = head + tuple(x + dp for x in tail)
                assert_applies_as_planned(book, pair, rank, m, s, 0, d0, p_rel, d_rel)
        d_ids = [tuple(5 + x for x in d_rel)]
        same = book.shape(m, s, m, [heads[2] + tail], d_ids)
        moved = book.shape(m, s, m, [heads[0] + (tail[0] + 50,) + tail[1:]], d_ids)  # (the first block read)
        assert same is not None and moved is not None and book.apply(same) is not None
        assert book.apply(moved) is None and moved.key != same.key


def test_a_clipped_window_list_is_keyed_whole() -> None:
    """vLLM clips a sliding window's lists to their last blocks: P's list then starts inside the
    hit (token 48 here, S = 64), and ids at its head ARE read. Requests that differ there are
    other shapes, and a shape's recipe gives the planner's rows for every shift. (Regression: the
    first 4 ids of every list were left out of the key, and a third request with other ids at
    positions 2-3 was posted from the recipe, reading the blocks of the learnt ones.)"""
    m = ModelSpec("m", [AttentionSpec("win", "sliding", 3, 4, 64, window_tokens=49)])
    pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=96, name="P"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=96, name="D"))
    M, S = 128, 64
    book = PullRecipes(PlanningLink(pair), STRATEGY, 0)  # type: ignore[arg-type]
    p_rel, d_rel = tuple(range(5)), tuple(range(3))  # P: blocks 3-7 of 8; D: tokens [80, 128)
    learn(book, pair, 0, M, S, 10, 20, p_rel, d_rel)
    learn(book, pair, 0, M, S, 30, 40, p_rel, d_rel)
    assert book.counts["learnt"] == 1, book.counts
    request = table(pair, M, S, 30, 40, p_rel, d_rel)
    assert request.groups[0].prefill.first_token == 48  # (the list starts inside the hit)
    for p0, d0 in ((50, 7), (1, 60)):
        assert_applies_as_planned(book, pair, 0, M, S, p0, d0, p_rel, d_rel)
    other = book.shape(M, S, M, [(50, 60, 70, 80, 34)], [(40, 41, 42)])  # ids at positions 2-3 differ
    assert other is not None and book.apply(other) is None


def test_a_plan_past_max_rows_is_planned_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = engines(16, 1, 16, 1)
    rel = tuple(range(4))
    for limit, want in ((3, "learnt"), (2, "refused")):  # 3 layers: 3 rows of this rank
        monkeypatch.setattr(recipes, "MAX_ROWS", limit)
        book = PullRecipes(PlanningLink(pair), STRATEGY, 0)  # type: ignore[arg-type]
        learn(book, pair, 0, 64, 0, 3, 5, rel, rel)
        learn(book, pair, 0, 64, 0, 9, 9, rel, rel)
        assert book.counts[want] == 1, (limit, book.counts)


class _Sub(np.ndarray):
    """An ndarray subclass: ``_lowered`` leaves it to ``_check_rows``' numpy check."""


@pytest.mark.parametrize("rows", [0, 1, 2, 32, 33, 200])
def test_post_pulls_descriptors_are_base_plus_offset_on_both_paths(rows: int) -> None:
    """``Link.post_pull`` lowers a few rows (<= 32) in one Python pass and more with numpy: both give
    each row (address = its region's base + offset, its bytes, its region's device), checked here by
    hand arithmetic, and both refuse the same row outside its region with the same error."""
    from kvgeom import PlanError
    from kvgeom_nixl import link

    sizes = [1 << 20, 3 << 20, 1 << 16]
    bases = [0x7F0000000000, 0x7F1000000000, 0x10000]
    devices = [0, 0, 3]
    regions = link._Regions(np.array(bases, dtype=np.uint64), np.array(devices, dtype=np.uint64),
                            np.array(sizes, dtype=np.int64), bases, devices, sizes)
    rng = np.random.default_rng(rows)
    region = rng.integers(0, 3, rows).astype(np.int64)
    nbytes = rng.integers(1, 4096, rows).astype(np.int64)
    offset = np.array([int(rng.integers(0, sizes[r] - b)) for r, b in zip(region, nbytes)], dtype=np.int64)
    got = link._lowered("d", region, offset, nbytes, regions)
    assert got.dtype == np.uint64 and got.shape == (rows, 3)
    assert got.tolist() == [[bases[r] + o, b, devices[r]] for r, o, b in zip(region.tolist(), offset.tolist(),
                                                                             nbytes.tolist())]
    if rows:
        bad = offset.copy()
        bad[-1] = sizes[int(region[-1])] - int(nbytes[-1]) + 1  # one byte past its region
        with pytest.raises(PlanError, match=rf"reads\.d_offset\[{rows - 1}\]"):
            link._lowered("d", region, bad, nbytes, regions)
        with pytest.raises(PlanError, match="int64"):
            link._lowered("d", region.astype(np.int32), offset, nbytes, regions)
        huge, one = offset.copy(), nbytes.copy()  # (offset + nbytes wraps past 2**63 in int64)
        huge[-1], one[-1] = 2**63 - 1, 1
        with pytest.raises(PlanError, match=rf"reads\.d_offset\[{rows - 1}\]"):
            link._lowered("d", region, huge, one, regions)
        with pytest.raises(PlanError, match=rf"reads\.d_offset\[{rows - 1}\]"):  # (a subclass: numpy's check)
            link._lowered("d", region.view(_Sub), huge, one, regions)
