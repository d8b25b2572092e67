"""Hostile input on the planner's newer doors (docs/design.md §13 and §14), found in review after
issue 11: the compiled pair's ``plan``/``copy_blocks`` checked neither their arguments nor the
budget, the budget's own entry points took an unchecked ``RequestShape``, a pair with thousands
of pipeline stages planned in time quadratic in the stages, and the simulator looped over every
rank before refusing an engine it could never allocate. Each test below fails on that code.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    EngineGeometry,
    IncompatibleGeometry,
    KvGeomError,
    ModelSpec,
    Pair,
    PlanBudgetExceeded,
    RequestError,
    RequestShape,
    check_budget,
    fresh_request,
    plan_pair,
    plan_reference,
    simulate,
)
from kvgeom.planning import estimate_compile, estimate_plan, min_staging_bytes, quick_estimate
from kvgeom.planning.topology import NOTE_STAGES
from kvgeom.values import Topology
from kvgeom.values import engine as engine_module
from kvgeom.values.request import ListingShape


def _small() -> tuple[Pair, Any]:
    model = ModelSpec("m", [AttentionSpec("a", "full", 4, 8, 256)])
    P = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=64, layout="NHD", name="prefill")
    D = EngineGeometry.build(model, tp=2, kernel_block_tokens=16, num_blocks=64, layout="HND", name="decode")
    pair = Pair(P, D)
    return pair, fresh_request(pair, 20)


@pytest.mark.parametrize("kwargs, error, path", [
    ({"request": None}, RequestError, "request"),
    ({"cost_model": None, "strategy": "auto"}, KvGeomError, "cost_model"),
    ({"strategy": np.array(["direct", "x"])}, KvGeomError, "strategy"),
    ({"strategy": "fastest"}, KvGeomError, "strategy"),
    ({"staging_bytes": -1}, KvGeomError, "staging_bytes"),
    ({"budget": 1}, KvGeomError, "budget"),
])
@pytest.mark.parametrize("method", ["plan", "copy_blocks"])
def test_compiled_pair_checks_its_arguments(method: str, kwargs: dict[str, Any], error: type, path: str) -> None:
    """Before: AttributeError ('NoneType' has no attribute 'groups' / 'exact_rows'), or numpy's
    'truth value of an array is ambiguous' ValueError."""
    pair, request = _small()
    compiled = pair.compile()
    call = dict(kwargs)
    req = call.pop("request", request)
    with pytest.raises(error) as info:
        getattr(compiled, method)(req, **call)
    assert info.value.path == path


def test_compiled_pair_refuses_a_plan_beyond_the_budget_before_building_it() -> None:
    """Before: ``compile().plan`` of a million tokens (an estimated ~100 GB plan) ran into numpy's
    MemoryError after allocating gigabytes; ``plan_pair`` of the same request was refused."""
    model = ModelSpec("m", [AttentionSpec("a", "full", 32, 8, 256)])
    P = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=70000, layout="NHD", name="prefill")
    D = EngineGeometry.build(model, tp=2, kernel_block_tokens=16, num_blocks=70000, layout="HND", name="decode")
    pair = Pair(P, D)
    request = fresh_request(pair, 1_000_000)
    compiled = pair.compile()
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        for strategy in ("direct", "staged"):
            with pytest.raises(PlanBudgetExceeded):
                compiled.plan(request, strategy=strategy)  # type: ignore[arg-type]
            with pytest.raises(PlanBudgetExceeded):
                compiled.copy_blocks(request, strategy=strategy)  # type: ignore[arg-type]
        with pytest.raises(PlanBudgetExceeded):  # one token per chunk: packed is over the budget too
            compiled.plan(request, strategy="auto", staging_bytes=min_staging_bytes(pair, request))
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 10 and peak < 100 * 2**20  # generous ceilings: the refusals take milliseconds


def test_compiled_auto_that_leaves_packed_out_equals_the_reference_plan() -> None:
    """The budget's AUTO_OVER_BUDGET path on the compiled pair: a staging capacity of one token per
    chunk makes packed too large, auto plans without it, with the same notes as the reference."""
    model = ModelSpec("m", [AttentionSpec("a", "full", 8, 8, 256)])
    P = EngineGeometry.build(model, tp=2, kernel_block_tokens=16, num_blocks=4200, name="prefill")
    D = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=4200, layout="NHD", name="decode")
    pair = Pair(P, D)
    request = fresh_request(pair, 65536)
    tiny = min_staging_bytes(pair, request)
    with pytest.raises(PlanBudgetExceeded):
        plan_reference(pair, request, strategy="packed", staging_bytes=tiny)
    reference = plan_reference(pair, request, strategy="auto", staging_bytes=tiny)
    compiled = pair.compile().plan(request, strategy="auto", staging_bytes=tiny)
    assert any(n.kind.name == "AUTO_OVER_BUDGET" for n in reference.notes)
    assert compiled.notes == reference.notes and not compiled.packed
    assert compiled.copies == reference.copies and compiled.zeros == reference.zeros


@pytest.mark.parametrize("call, error, path", [
    (lambda pair, shape: check_budget(pair, None), RequestError, "shape"),
    (lambda pair, shape: check_budget(1, shape), IncompatibleGeometry, "pair"),
    (lambda pair, shape: check_budget(pair, shape, budget=1), KvGeomError, "budget"),
    (lambda pair, shape: check_budget(pair, shape, budget=None), KvGeomError, "budget"),
    (lambda pair, shape: estimate_plan(pair, shape, "x"), KvGeomError, "strategy"),
    (lambda pair, shape: quick_estimate(pair, shape, "x"), KvGeomError, "strategy"),
    (lambda pair, shape: estimate_plan(pair, None), RequestError, "shape"),
    (lambda pair, shape: estimate_compile(None), IncompatibleGeometry, "pair"),
    (lambda pair, shape: ListingShape(0, "3"), RequestError, "ListingShape.count"),
    (lambda pair, shape: RequestShape(1, 0, None), RequestError, "RequestShape.groups"),
    (lambda pair, shape: RequestShape(1, 0, (1, 2)), RequestError, "RequestShape.groups[0]"),
    (lambda pair, shape: RequestShape(2**200, 0, ()), RequestError, "RequestShape.computed_tokens"),
    (lambda pair, shape: RequestShape(1, 0, (), state_pairs=("a",)), RequestError, "RequestShape.state_pairs[0]"),
])
def test_the_budget_entry_points_check_what_they_are_given(call: Any, error: type, path: str) -> None:
    """Before: AttributeError / TypeError, or an unknown strategy estimated as if it were one."""
    pair, request = _small()
    with pytest.raises(error) as info:
        call(pair, RequestShape.of(request))
    assert info.value.path == path


def test_a_numpy_shape_cannot_wrap_past_the_budget() -> None:
    """Before: numpy int64 fields of 2**53 tokens overflowed inside the estimate (negative work) and
    ``check_budget`` admitted the request. Now the fields are Python ints capped at 2**48."""
    pair, _ = _small()
    M = np.int64(2**53)
    with pytest.raises(RequestError):
        check_budget(pair, RequestShape(M, np.int64(0), ((ListingShape(np.int64(0), M),
                                                          ListingShape(np.int64(0), M)),)), "auto")
    shape = RequestShape(np.int64(32), np.int64(0), ((ListingShape(np.int64(0), np.int64(2)),
                                                      ListingShape(np.int64(0), np.int64(2))),))
    assert type(shape.computed_tokens) is int and type(shape.groups[0][0].count) is int


def test_thousands_of_pipeline_stages_plan_in_time_linear_in_the_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the TOPOLOGY note asked every stage for its layers, and each answer rebuilt all the
    stages' slices: 4096 stages took 6-9 s per plan (16.8M Slice objects) and the note listed 4096
    ranges. Now the slices are built once per engine and the note lists at most NOTE_STAGES."""
    calls = {"n": 0}
    real = engine_module.stage_slices

    def counted(counts: tuple[int, ...]) -> Any:
        calls["n"] += 1
        return real(counts)

    monkeypatch.setattr(engine_module, "stage_slices", counted)
    model = ModelSpec("m", [AttentionSpec("a", "full", 4096, 4, 256)])
    P = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=4, layout="NHD",
                             topology=Topology(pp=4096), name="prefill")
    D = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=4, layout="NHD", name="decode")
    pair = Pair(P, D)
    request = fresh_request(pair, 16)
    plans = [plan_pair(pair, request, strategy=s) for s in ("direct", "direct", "packed")]  # reference, compiled, packed
    assert calls["n"] <= 2  # once per engine (P's stages; D has one)
    (note,) = [n for n in plans[0].notes if n.kind.name == "TOPOLOGY"]
    assert note.text.count("[") <= NOTE_STAGES and "4088 more" in note.text and "[4095, 4096)" in note.text
    assert len(plans[0].copies) == 4096 and plans[1].copies == plans[0].copies  # one row per stage's layer


def test_the_simulator_refuses_an_engine_it_cannot_allocate_before_looping_over_its_ranks() -> None:
    """Before: 2**20 ranks (131,072 replicas of TP8) spent 5.6 s in the per-rank bounds checks
    before ``Memory.allocate`` refused 4 TB."""
    model = ModelSpec("m", [AttentionSpec("a", "full", 2, 8, 256)])
    P = EngineGeometry.build(model, tp=8, kernel_block_tokens=16, num_blocks=64, topology=Topology(replicas=131072),
                             name="prefill")
    D = EngineGeometry.build(model, tp=4, kernel_block_tokens=16, num_blocks=64, name="decode")
    pair = Pair(P, D)
    request = fresh_request(pair, 100)
    plan = pair.plan(request)
    t0 = time.perf_counter()
    with pytest.raises(PlanBudgetExceeded) as info:
        simulate(pair, request, plan)
    assert time.perf_counter() - t0 < 2  # milliseconds now; the old per-rank loops took seconds
    assert info.value.path == "Memory.allocate(prefill)"
