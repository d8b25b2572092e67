"""Hostile-input campaigns: kvgeom and its executor tried as an attacker would, with bounded mutation fuzzers.

    python -m benchmarks.hostile                          # the issue's counts (about 30 min on 2 cores)
    python -m benchmarks.hostile --quick                  # 1/100 of them (about a minute)
    python -m benchmarks.hostile --only api,files --count api=3000 --jobs 2 --json

Five campaigns, each a stream of cases drawn from ``random.Random(seed * 1_000_003 + index)`` (so a
case is reproduced from its index alone, ``--case api:1234``)::

    api          pairable / plan_transfer (every strategy, hostile staging_bytes) / fresh_request / constructors
                 with wrong types and extreme sizes
    files        pair files (load_pair_file + plan + simulate), mutated as JSON and as bytes
    cli          `kvgeom plan --pair FILE` and hostile flags (--tokens, --layers, --svg, --timeout, --staging-bytes),
                 one process each
    handshakes   a peer's handshake payload mutated, then connect (and a pull if it connects), real NIXL
    lying        a peer whose handshake lies about its geometry, pulled through real NIXL, D's tensors
                 inside guard bytes

Every case runs in a worker process (a fresh one after each hang) with its data segment capped
(``RLIMIT_DATA``), so a runaway allocation is a ``MemoryError``, not a machine brought down. A case's
outcome is one of::

    ok       it returned (and the oracle found nothing wrong)      typed    a KvGeomError (not InternalError)
    failed   a pull ended in TransferFailed (the executor's        other    any other exception, or an InternalError
             typed failure: a lying peer's memory, a timeout)      hang     no answer within --hang-s (10 s)
    wrong    returned, but the oracle says it must not have (an accepted document that must be
             refused, a plan the simulator rejects, a numpy int kept in a field, an honest peer
             that can no longer connect after the case)

The table (``render``) gives per campaign: tried, ok, typed, transfer failed, other, hang, wrong,
bytes written outside D's writable pages and its guard bytes (handshakes and lying pulls), and
the largest wall time (ms) and tracemalloc peak (MB) of a typed refusal. The goal (issue 11): 0 other, 0 hang, 0 wrong, 0 bytes
outside, every refusal under 100 ms and 100 MB.

The generators (``api_case``, ``pair_file_case``, ``cli_case``, ``handshake_case``, ``lying_case``)
and the runners are shared with ``tests/test_hostile_*.py``, which draw the index with hypothesis
(derandomized, a few hundred cases) and assert the same outcomes.

Worked number: ``api_case(random.Random(7))`` is one call; a campaign of 30,000 such calls at about
1 ms each takes 30 s in one worker plus the hangs (10 s each) the old code had.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import json
import multiprocessing as mp
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = [
    "CAMPAIGNS",
    "ISSUE_COUNTS",
    "Outcome",
    "Case",
    "api_case",
    "pair_file_case",
    "cli_case",
    "classify",
    "run_api",
    "run_pair_file",
    "run_cli",
    "campaign",
    "render",
    "main",
]

CAMPAIGNS = ("api", "files", "cli", "handshakes", "lying")
KINDS = ("ok", "typed", "failed", "other", "hang", "wrong")
ISSUE_COUNTS = {"api": 30_000, "files": 10_000, "cli": 300, "handshakes": 3_000, "lying": 300}
HANG_S = 10.0
DATA_LIMIT = 6 << 30  # bytes of data segment a worker may hold (RLIMIT_DATA)
GOAL_MS = 100.0
GOAL_MB = 100.0
HUGE_DIGITS = 5000  # a JSON integer longer than Python's int <-> str limit (4300 digits)


@attrs.frozen
class Outcome:
    """What one case gave (plain data: it crosses the worker pipe)."""

    kind: str  # ok | typed | failed | other | hang | wrong
    ms: float = 0.0
    mb: float = 0.0
    detail: str = ""
    outside: int = 0  # bytes changed outside D's writable pages (and guards)
    label: str = ""


@attrs.frozen
class Case:
    """A call and the oracle that judges its result (``check(result) -> why it is wrong`` or ``""``)."""

    label: str
    call: Callable[[], Any]
    check: Callable[[Any], str] = lambda _: ""
    must_reject: bool = False


def rng(campaign_name: str, seed: int, index: int) -> random.Random:
    """The generator of case ``index`` (independent of every other case)."""
    return random.Random(f"{campaign_name}:{seed}:{index}")


# ---- classification ----------------------------------------------------------------------------------


def _kind_of(e: BaseException) -> str:
    """``typed`` for a refusal (a KvGeomError that is not an InternalError), ``failed`` for the
    executor's TransferFailed, ``other`` for anything else."""
    from kvgeom import InternalError, KvGeomError

    if isinstance(e, InternalError):
        return "other"  # a kvgeom bug, never a refusal
    if isinstance(e, KvGeomError):
        return "typed"
    return "failed" if type(e).__name__ == "TransferFailed" else "other"


def classify(case: Case, *, measure: bool = True, twice: bool = False) -> Outcome:
    """Run ``case``: its outcome, wall ms and tracemalloc peak (MB).

    With ``twice`` (a case without side effects) the wall time comes from a first run without
    tracemalloc (which slows object creation several-fold) and, for a refusal, the peak from a
    second, traced run.
    """
    if twice and measure:
        out = _run(case, traced=False)
        if out.kind == "typed":  # the table reports the memory of refusals
            mb = _run(case, traced=True).mb
            out = attrs.evolve(out, mb=mb)
        return out
    return _run(case, traced=measure)


def _run(case: Case, *, traced: bool) -> Outcome:
    started = False
    base = 0
    if traced:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
            started = True
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]

    def peak() -> float:
        return (tracemalloc.get_traced_memory()[1] - base) / 2**20 if traced else 0.0

    t0 = time.perf_counter()
    try:
        result = case.call()
    except BaseException as e:  # noqa: BLE001 - every escape is classified
        ms, mb = (time.perf_counter() - t0) * 1e3, peak()
        if started:
            tracemalloc.stop()
        if isinstance(e, KeyboardInterrupt):
            raise
        kind = _kind_of(e)
        detail = f"{type(e).__name__}: {_text(e)}"
        if kind == "other":
            detail += " @ " + _where(e)
        return Outcome(kind, ms, mb, detail[:400], label=case.label)
    ms, mb = (time.perf_counter() - t0) * 1e3, peak()
    if started:
        tracemalloc.stop()
    try:
        why = case.check(result)
    except BaseException as e:  # noqa: BLE001 - a failing oracle is reported, not hidden
        why = f"oracle raised {type(e).__name__}: {_text(e)}"
    if why:
        return Outcome("wrong", ms, mb, why[:400], label=case.label)
    if case.must_reject:
        return Outcome("wrong", ms, mb, "accepted input that must be rejected", label=case.label)
    return Outcome("ok", ms, mb, label=case.label)


def _text(e: BaseException) -> str:
    try:
        return str(e)[:300]
    except Exception:  # noqa: BLE001 - str() of an int beyond 4300 digits raises
        return "<unprintable>"


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f for f in tb if "kvgeom" in f.filename] or list(tb)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


# ---- value pools ---------------------------------------------------------------------------------------

HUGE = 10**HUGE_DIGITS
EXTREME_INTS: tuple[Any, ...] = (
    -1, 0, 2**31, 2**32 + 1, 2**40, 2**47 + 1, 2**48, 2**48 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, HUGE,
    np.int8(-1), np.int32(9000), np.int32(2**20), np.int32(-5), np.uint64(0), np.uint64(2**63), np.int64(2**62),
    np.uint8(200), np.int16(7),
)
WRONG_TYPES: tuple[Any, ...] = (
    None, True, False, 1.0, float("nan"), float("inf"), -0.0, "3", "", b"3", [], [1], [None], (), {}, {"a": 1},
    object(), 1 + 2j, np.float64(2.0), np.array([1, 2]), np.bool_(True), np.array(3), range(3), [[1]], ["x"],
)


def _r(v: Any) -> str:
    """repr() that survives integers beyond Python's int -> str limit and long containers."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 256:
        return f"<int of {v.bit_length()} bits>"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_r(x) for x in list(v)[:8]) + (", ..." if len(v) > 8 else "")
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_r(k)}: {_r(x)}" for k, x in list(v.items())[:8]) + "}"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def hostile(r: random.Random) -> Any:
    """A value from the pools: an extreme integer or a wrong type."""
    pool = EXTREME_INTS if r.random() < 0.5 else WRONG_TYPES
    return r.choice(pool)


def maybe(r: random.Random, good: Any, p: float) -> Any:
    return hostile(r) if r.random() < p else good


# ---- valid starting points -----------------------------------------------------------------------------


def small_model(r: random.Random, *, state: bool = False) -> Any:
    from kvgeom import AttentionSpec, ModelSpec, StateSection, StateSpec

    groups: list[Any] = []
    for i in range(r.randint(1, 2)):
        kind = r.choice(("full", "full", "sliding", "mla"))
        layers = r.randint(1, 2)
        hb = r.choice((8, 16, 32))
        if kind == "mla":
            groups.append(AttentionSpec(f"g{i}", "mla", layers, 1, hb))
        else:
            heads = r.choice((1, 2, 4, 8))
            groups.append(AttentionSpec(f"g{i}", kind, layers, heads, hb,
                                        window_tokens=r.choice((8, 24, 40)) if kind == "sliding" else None))
    if state:
        groups.append(StateSpec("s", r.randint(1, 2), (StateSection("x", 8, 4, rows=3), StateSection("h", 4, 16))))
    return ModelSpec("m", tuple(groups))


def small_topology(r: random.Random, model: Any, tp: int, K: int) -> Any:
    """One stage, no DCP, one replica most of the time; else a few stages, a DCP group, replicas
    (docs/design.md §11) that fit ``model``, ``tp`` and ``K``."""
    from kvgeom.tools.strategies import valid_dcps
    from kvgeom.values import Topology

    if r.random() < 0.7:
        return None
    pp = r.randint(1, min(3, model.num_global_layers))
    dcp = r.choice(valid_dcps(model, tp, 4))
    interleave = r.choice([i for i in range(1, K + 1) if K % i == 0]) if dcp > 1 else 1
    return Topology(pp, None, dcp, interleave, r.randint(1, 2))


def small_engine(r: random.Random, model: Any, name: str, *, tp: int | None = None, blocks: int = 12) -> Any:
    from kvgeom import EngineGeometry
    from kvgeom.building.presets import hybrid_blocks_per_logical
    from kvgeom.tools.strategies import valid_tps

    tps = valid_tps(model, 8)
    tp = r.choice(tps) if tp is None else tp
    K = r.choice((1, 2, 4, 8))
    hybrid = any(g.kind.value == "state" for g in model.groups)
    ppl = hybrid_blocks_per_logical(model, tp=tp, kernel_block_tokens=K) if hybrid else r.choice((1, 2))
    topology = small_topology(r, model, tp, K)
    if hybrid and topology is not None and topology.dcp > 1:
        topology = None  # vLLM refuses hybrids with DCP; keep the drawn engines realistic
    return EngineGeometry.build(
        model, tp=tp, kernel_block_tokens=K, num_blocks=blocks, blocks_per_logical=ppl,
        layout=r.choice(("HND", "NHD")), kv="packed" if hybrid else r.choice(("packed", "split", "inner")),
        regions="shared" if hybrid else r.choice(("per_layer", "interleaved")), name=name, topology=topology)


def small_pair(r: random.Random) -> tuple[Any, Any]:
    """(Pair, Request) of a small valid pair with a fresh request (sometimes a prefix hit)."""
    from kvgeom import Pair, fresh_request

    model = small_model(r, state=r.random() < 0.25)
    P = small_engine(r, model, "prefill")
    D = small_engine(r, model, "decode")
    pair = Pair(P, D)
    hybrid = any(g.kind.value == "state" for g in model.groups)
    B = D.logical_block_tokens
    M = r.randint(1, 4 * max(B, P.logical_block_tokens))
    S = r.randint(0, M // B) * B if r.random() < 0.3 else 0
    if S >= M and hybrid:
        S = 0
    cap = min(P.num_logical_blocks(0), D.num_logical_blocks(0))
    while True:
        try:
            req = fresh_request(pair, M, decode_tokens=M + 1 if hybrid else M, prefix_hit_tokens=S)
            pair.check_request(req)
            return pair, req
        except Exception:  # noqa: BLE001 - too long for the pools: shorten
            if M <= 1:
                raise
            M = max(1, M // 2)
            S = min(S, M // B * B) if not hybrid else 0
            if cap <= 0:
                raise


# ---- oracles -------------------------------------------------------------------------------------------

SIM_BYTES = 32 << 20  # simulate plans of engines up to this many bytes per side
SIM_RANKS = 64  # ... and this many ranks on both sides together (the simulator loops over ranks in Python)


def _engine_bytes(e: Any) -> int:
    return int(e.total_bytes)


def int_fields_wrong(obj: Any, path: str = "", depth: int = 0) -> str:
    """A field annotated ``int`` that does not hold a Python int (e.g. a numpy integer kept as given)."""
    if depth > 6 or not attrs.has(type(obj)):
        return ""
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        ann = str(f.type)
        if ann in ("int", "<class 'int'>") and type(v) is not int:
            return f"{path}{type(obj).__name__}.{f.name} holds {type(v).__name__}"
        if isinstance(v, tuple):
            for i, x in enumerate(v[:64]):
                if "tuple[int" in ann and type(x) is not int:
                    return f"{path}{type(obj).__name__}.{f.name}[{i}] holds {type(x).__name__}"
                why = int_fields_wrong(x, f"{path}{f.name}[{i}].", depth + 1)
                if why:
                    return why
        else:
            why = int_fields_wrong(v, f"{path}{f.name}.", depth + 1)
            if why:
                return why
    return ""


def plan_wrong(pair: Any, request: Any, plan: Any) -> str:
    """Why an accepted plan is wrong: arithmetic beyond int64, rows outside regions, simulator violations."""
    from kvgeom import simulate

    for side in (pair.prefill, pair.decode):
        for i, reg in enumerate(side.regions):
            if int(reg.num_pages) * int(reg.page_bytes) >= 2**63:
                return f"planned with {side.name} region {i} of {int(reg.num_pages) * int(reg.page_bytes)} B (beyond int64)"
    c = plan.copies
    for side, rk, rg, off in (("prefill", c.p_rank, c.p_region, c.p_offset), ("decode", c.d_rank, c.d_region,
                                                                              c.d_offset)):
        eng = pair.side(side)
        sizes = [int(x.num_pages) * int(x.page_bytes) for x in eng.regions]
        for k in range(min(len(c), 4096)):
            rank, region = int(rk[k]), int(rg[k])
            if rank >= eng.num_ranks or region not in eng.rank_regions(rank) or \
                    int(off[k]) + int(c.nbytes[k]) > sizes[region]:
                return f"copy row {k} leaves the {side} engine"
    small = pair.prefill.num_ranks + pair.decode.num_ranks <= SIM_RANKS
    if small and _engine_bytes(pair.prefill) <= SIM_BYTES and _engine_bytes(pair.decode) <= SIM_BYTES:
        report = simulate(pair, request, plan)
        if not report.ok:
            return "simulator: " + str(report).splitlines()[0][:200]
    return ""


# ---- campaign: API values ------------------------------------------------------------------------------


def api_case(r: random.Random) -> Case:
    """One call of the public API with some arguments replaced by extreme integers or wrong types."""
    kind = r.choice(("region", "layout", "attention_spec", "section", "state_spec", "model", "build", "engine",
                     "block_list", "state_slots", "request", "pair", "pairable", "plan", "plan", "plan",
                     "fresh_request", "plan_objects", "big_plan", "big_plan"))
    return _API[kind](r)


def _region(r: random.Random) -> Case:
    from kvgeom import Region

    a, b = maybe(r, r.randint(1, 64), 0.6), maybe(r, r.choice((64, 4096)), 0.6)

    def check(reg: Any) -> str:
        if type(a) is not bool and isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
            if reg.nbytes != int(a) * int(b):
                return f"Region({_r(a)}, {_r(b)}).nbytes == {reg.nbytes}, not {int(a) * int(b)}"
        return int_fields_wrong(reg)

    return Case(f"Region({_r(a)}, {_r(b)})", lambda: Region(a, b), check)


def _layout(r: random.Random) -> Case:
    from kvgeom import PageLayout

    args = [maybe(r, r.choice((0, 8, 64)), 0.4) for _ in range(3)]
    return Case(f"PageLayout{_r(tuple(args))}", lambda: PageLayout(*args), int_fields_wrong)


def _attention_spec(r: random.Random) -> Case:
    from kvgeom import AttentionSpec

    kind = r.choice(("full", "sliding", "mla"))
    args = [maybe(r, "g", 0.15), maybe(r, kind, 0.15), maybe(r, 2, 0.3), maybe(r, 1 if kind == "mla" else 4, 0.3),
            maybe(r, 16, 0.3), maybe(r, 8 if kind == "sliding" else None, 0.3)]
    return Case(f"AttentionSpec{_r(tuple(args))}", lambda: AttentionSpec(*args), int_fields_wrong)


def _section(r: random.Random) -> Case:
    from kvgeom import StateSection

    args = [maybe(r, "x", 0.15), maybe(r, 8, 0.3), maybe(r, 4, 0.3), maybe(r, 3, 0.3), maybe(r, False, 0.2)]
    return Case(f"StateSection{_r(tuple(args))}", lambda: StateSection(*args), int_fields_wrong)


def _state_spec(r: random.Random) -> Case:
    from kvgeom import StateSection, StateSpec

    sections: Any = [StateSection("x", 8, 4, rows=3)]
    if r.random() < 0.4:
        sections = maybe(r, sections, 1.0)
    elif r.random() < 0.5:
        sections = [hostile(r)]
    args = [maybe(r, "s", 0.2), maybe(r, 2, 0.3), sections]
    return Case(f"StateSpec{_r(tuple(args))}", lambda: StateSpec(*args), int_fields_wrong)


def _model(r: random.Random) -> Case:
    from kvgeom import ModelSpec

    base = small_model(r, state=r.random() < 0.3)
    groups: Any = list(base.groups)
    if r.random() < 0.5:
        groups[r.randrange(len(groups))] = hostile(r)
    elif r.random() < 0.3:
        groups = hostile(r)
    args = [maybe(r, "m", 0.3), groups, maybe(r, "bfloat16", 0.3)]
    return Case(f"ModelSpec(..{len(args)} args)", lambda: ModelSpec(*args), int_fields_wrong)


def _build_kwargs(r: random.Random, p: float) -> dict[str, Any]:
    return {"tp": maybe(r, r.choice((1, 2)), p), "kernel_block_tokens": maybe(r, r.choice((1, 4, 16)), p),
            "num_blocks": maybe(r, r.choice((4, 16)), p), "blocks_per_logical": maybe(r, 1, p / 2),
            "layout": maybe(r, r.choice(("HND", "NHD")), p / 3), "kv": maybe(r, "packed", p / 3),
            "regions": maybe(r, r.choice(("per_layer", "interleaved")), p / 3), "name": maybe(r, "e", p / 3)}


def _build(r: random.Random) -> Case:
    from kvgeom import EngineGeometry

    model = small_model(r)
    kw = _build_kwargs(r, 0.3)
    return Case(f"EngineGeometry.build(model, **{_r(kw)})", lambda: EngineGeometry.build(model, **kw), int_fields_wrong)


def _engine(r: random.Random) -> Case:
    """``EngineGeometry(...)`` from a valid engine's fields with one nested field replaced."""
    from kvgeom import AttentionGroupGeometry, AttentionView, EngineGeometry, PageLayout, Region

    model = small_model(r)
    e = small_engine(r, model, "e")
    what = r.choice(("model", "tp", "kernel_block_tokens", "blocks_per_logical", "regions", "region", "groups",
                     "group", "views", "view", "layout", "name", "stride", "offset"))
    bad = hostile(r)
    pick = r.random()
    region_i = r.randrange(len(e.regions))
    size = (r.choice((1, 2**17, 2**40)), r.choice((1, 2**30, 2**48)))
    stride_i = r.randrange(3)
    stride = r.choice((0, 1, 2**20, 2**47, 2**48, 2**48 + 1, -1, np.int32(7), np.uint64(8)))
    offset = r.choice((2**30, 2**47, 2**48, np.int32(4), np.uint64(2**40)))
    view_i = r.randrange(len(e.groups[0].views))

    def call() -> Any:
        fields: dict[str, Any] = {"model": e.model, "tp": e.tp, "kernel_block_tokens": e.kernel_block_tokens,
                                  "blocks_per_logical": e.blocks_per_logical, "regions": list(e.regions),
                                  "groups": list(e.groups), "name": e.name}
        g = e.groups[0]
        if what in fields:
            fields[what] = bad
        elif what == "region":
            fields["regions"][region_i] = bad if pick < 0.5 else Region(*size)
        elif what == "group":
            fields["groups"][0] = bad
        elif what in ("views", "view"):
            views: Any = list(g.views)
            if what == "views":
                views = bad
            else:
                views[view_i] = bad
            fields["groups"][0] = AttentionGroupGeometry(g.layout, views)
        elif what == "layout":
            fields["groups"][0] = AttentionGroupGeometry(bad, g.views)
        elif what == "stride":
            vals = [g.layout.kv_stride, g.layout.head_stride, g.layout.token_stride]
            vals[stride_i] = stride
            fields["groups"][0] = AttentionGroupGeometry(PageLayout(*vals), g.views)
        else:
            views = list(g.views)
            views[0] = AttentionView(views[0].regions, offset)
            fields["groups"][0] = AttentionGroupGeometry(g.layout, views)
        return EngineGeometry(**fields)

    return Case(f"EngineGeometry(.. {what} replaced ..)", call, int_fields_wrong)


def _block_list(r: random.Random) -> Case:
    from kvgeom import BlockList

    ids: Any = [r.randint(0, 20) for _ in range(r.randint(0, 4))]
    ids = list(dict.fromkeys(ids))
    if r.random() < 0.4 and ids:
        ids[r.randrange(len(ids))] = hostile(r)
    elif r.random() < 0.2:
        ids = hostile(r)
    elif r.random() < 0.2:
        ids = np.array(ids, dtype=r.choice((np.uint64, np.int32, np.float64)))
    first = maybe(r, r.choice((0, 16)), 0.4)
    return Case(f"BlockList({_r(ids)}, {_r(first)})", lambda: BlockList(ids, first), int_fields_wrong)


def _state_slots(r: random.Random) -> Case:
    from kvgeom import StateSlots

    ids: Any = [maybe(r, 3, 0.3)]
    toks: Any = [maybe(r, 40, 0.3)]
    if r.random() < 0.2:
        toks = hostile(r)
    return Case(f"StateSlots({_r(ids)}, {_r(toks)})", lambda: StateSlots(ids, toks), int_fields_wrong)


def _request(r: random.Random) -> Case:
    from kvgeom import Request

    pair, req = small_pair(r)
    groups: Any = list(req.groups)
    if r.random() < 0.3:
        groups[r.randrange(len(groups))] = hostile(r)
    elif r.random() < 0.2:
        groups = hostile(r)
    args = [maybe(r, req.computed_tokens, 0.3), groups, maybe(r, req.prefix_hit_tokens, 0.3)]
    return Case("Request(..)", lambda: Request(*args), int_fields_wrong)


def _pair(r: random.Random) -> Case:
    from kvgeom import Pair

    pair, _ = small_pair(r)
    P, D = pair.prefill, pair.decode
    if r.random() < 0.5:
        P = hostile(r)
    else:
        D = hostile(r) if r.random() < 0.5 else small_engine(r, small_model(r), "decode")
    return Case("Pair(..)", lambda: Pair(P, D))


def _pairable(r: random.Random) -> Case:
    from kvgeom import pairable

    pair, _ = small_pair(r)
    other = small_engine(r, small_model(r), "decode")
    args = (pair.prefill, other if r.random() < 0.6 else hostile(r))
    return Case("pairable(..)", lambda: pairable(*args))


def _plan(r: random.Random) -> Case:
    """plan_transfer on a valid pair with the request (or its listings, or the strategy) made hostile."""
    from kvgeom import BlockList, GroupRequest, Request, plan_transfer

    pair, req = small_pair(r)
    strategy: Any = r.choice(("direct", "staged", "auto", "packed"))
    what = r.choice(("request", "strategy", "staging", "ids", "first", "M", "S", "none"))
    staging: Any = r.choice((1 << 20, 0, 1, 7, 64, 4096, 2**62, -1, 2.5, "lots", None, np.int64(4096)))
    bad = hostile(r)
    gi = r.randrange(len(req.groups))
    extra_id = r.choice((2**40, 2**47, 2**48, 10**6))
    first_token = r.choice((2**40, 2**48, 2**47 + 1))
    big_m = r.choice((2**40, 2**48))
    small_s = r.choice((2**30, 3))
    box: list[Any] = [req]

    def call() -> Any:
        request: Any = req
        strat = strategy
        kw: dict[str, Any] = {"staging_bytes": staging} if what == "staging" else {}
        if what == "request":
            request = bad
        elif what == "strategy":
            strat = bad
        elif what in ("ids", "first"):
            g = req.groups[gi]
            if isinstance(g.decode, BlockList):
                ids, first = list(g.decode.block_ids), g.decode.first_token
                if what == "ids":
                    ids.append(extra_id)
                else:
                    first = first_token
                groups = list(req.groups)
                groups[gi] = GroupRequest(g.prefill, BlockList(ids, first))
                request = Request(req.computed_tokens, groups, req.prefix_hit_tokens)
        elif what in ("M", "S"):
            M = req.computed_tokens if what == "S" else big_m
            request = Request(M, req.groups, req.prefix_hit_tokens if what == "M" else min(M, small_s))
        box[0] = request
        return plan_transfer(pair.prefill, pair.decode, request, strategy=strat, **kw)

    return Case(f"plan_transfer({what})", call, lambda plan: plan_wrong(pair, box[0], plan))


def _fresh_request(r: random.Random) -> Case:
    from kvgeom import fresh_request

    pair, _ = small_pair(r)
    M = maybe(r, 40, 0.5)
    kw = {"decode_tokens": maybe(r, None, 0.2), "prefix_hit_tokens": maybe(r, 0, 0.2)}
    return Case(f"fresh_request(pair, {_r(M)}, **{_r(kw)})", lambda: fresh_request(pair, M, **kw), int_fields_wrong)


def _plan_objects(r: random.Random) -> Case:
    from kvgeom import Copies, Rearrange, TransferPlan, Zeros

    what = r.choice(("copies", "zeros", "rearrange", "plan"))
    cols = [np.array([0, 1], np.int64) for _ in range(6)] + [np.array([4, 4], np.int64)]
    if what == "copies":
        i = r.randrange(7)
        options: tuple[Any, ...] = (np.array([2**62, 2**63 - 1], np.int64), np.array([-1, 0]), np.array([1.5, 2.0]),
                   np.array([[1, 2]]), [None, 1], np.array([2**64 - 1, 0], np.uint64), hostile(r))
        cols[i] = r.choice(options)
        return Case("Copies(..)", lambda: Copies(*cols))
    if what == "zeros":
        zcols = cols[3:]
        zcols[r.randrange(4)] = r.choice((np.array([2**63 - 1, 1], np.int64), hostile(r)))
        return Case("Zeros(..)", lambda: Zeros(*zcols))
    if what == "rearrange":
        kw: dict[str, Any] = {"d_rank": 0, "d_region": 0, "pages": [0, 1], "shape": (2, 4), "src_strides": (8, 16),
                              "dst_strides": (32, 8), "unit_bytes": 8, "page_bytes": 64}
        key = r.choice(list(kw))
        kw[key] = r.choice(((2**47, 1), (2**40,), (0, 0), 2**48 + 1, np.int32(3), [1.5], hostile(r)))
        if key == "shape" and r.random() < 0.5:
            kw.update(src_strides=(0,) * len(kw["shape"]) if isinstance(kw["shape"], tuple) else (0,),
                      dst_strides=(0,) * len(kw["shape"]) if isinstance(kw["shape"], tuple) else (0,))
        return Case(f"Rearrange({key}=..)", lambda: Rearrange(**kw).dst_offsets())
    c = Copies(*cols)
    z = Zeros(*cols[3:])
    args = [maybe(r, 2, 0.4), maybe(r, 2, 0.4), c if r.random() < 0.8 else hostile(r),
            z if r.random() < 0.8 else hostile(r)]
    return Case("TransferPlan(..)", lambda: TransferPlan(*args), int_fields_wrong)


def _big_plan(r: random.Random) -> Case:
    """A valid-looking pair that claims extreme sizes (as a remote could), then a small request."""
    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request, plan_transfer

    heads = r.choice((8, 8, 2**47 + 1, 2**20, 2**40))
    layers = r.choice((2, 2, 2**10, 10**5, 2**20))
    head_bytes = r.choice((16, 2**20))
    big: dict[str, Any] = {"tp": r.choice((1, 2, 2**20, 2**40, 8)), "kernel_block_tokens": r.choice((16, 2**20, 2**30)),
           "num_blocks": r.choice((8, 2**17, 2**40, 65537)), "blocks_per_logical": r.choice((1, 1, 2**20, 2**30))}
    topo = r.choice((None, None, {"pp": 2}, {"replicas": 2**20}, {"replicas": 2**40}, {"pp": 2**20},
                     {"dcp": 8, "interleave": 16}, {"dcp": 2**20}))
    tokens = r.choice((32, 10**6, 10**8, 2**40))
    long = r.random() < 0.5

    def call() -> Any:
        from kvgeom.values import Topology

        model = ModelSpec("m", [AttentionSpec("attn", "full", layers, heads, head_bytes)])
        P = EngineGeometry.build(model, tp=8 if heads == 8 else 1, kernel_block_tokens=16, num_blocks=8,
                                 name="prefill")
        D = EngineGeometry.build(model, name="decode", topology=None if topo is None else Topology(**topo), **big)
        pair = Pair(P, D)
        req = fresh_request(pair, tokens if long else min(tokens, 8 * 16))
        return pair, req, plan_transfer(P, D, req)

    return Case(f"big plan heads={heads} layers={layers} {big} {topo} M={tokens if long else min(tokens, 128)}", call,
                lambda out: plan_wrong(out[0], out[1], out[2]))


_API: dict[str, Callable[[random.Random], Case]] = {
    "region": _region, "layout": _layout, "attention_spec": _attention_spec, "section": _section,
    "state_spec": _state_spec, "model": _model, "build": _build, "engine": _engine, "block_list": _block_list,
    "state_slots": _state_slots, "request": _request, "pair": _pair, "pairable": _pairable, "plan": _plan,
    "fresh_request": _fresh_request, "plan_objects": _plan_objects, "big_plan": _big_plan,
}


def run_api(r: random.Random, *, measure: bool = True) -> Outcome:
    return classify(api_case(r), measure=measure, twice=True)


# ---- campaign: pair files ------------------------------------------------------------------------------


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


JSON_HOSTILE: tuple[Any, ...] = (
    -1, 0, 1, 2**31, 2**47 + 1, 2**48, 2**48 + 1, 2**63, 2**64, 10**30, 1.5, 1e300, -0.0, "x", "", None, True,
    [], {}, [0] * 4, {"type": "Region"}, "@@HUGE@@", "@@DEEP@@", "@@NAN@@",
)


def _mutate_doc(r: random.Random, doc: Any) -> tuple[Any, bool, str]:
    """(mutated doc, must the decoder reject it, what was done)."""
    paths = [(p, v) for p, v in _paths(doc) if p]
    what = r.choice(("leaf", "leaf", "leaf", "delete", "unknown_key", "nested_schema", "schema", "duplicate",
                     "scale", "swap_type", "tp", "heads", "pages"))
    if what in ("leaf", "scale"):
        path, value = r.choice(paths)
        if what == "scale" and isinstance(value, int) and not isinstance(value, bool):
            new = value * r.choice((2**16, 2**32, 2**47, 65537)) + r.choice((0, 1))
            _set(doc, path, new)
            return doc, False, f"scale {path}"
        _set(doc, path, r.choice(JSON_HOSTILE))
        return doc, False, f"leaf {path}"
    if what == "delete":
        path, _ = r.choice([(p, v) for p, v in paths if isinstance(p[-1], str)])
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
        return doc, False, f"delete {path}"
    objects = [(p, v) for p, v in _paths(doc) if isinstance(v, dict)]
    if what == "unknown_key":
        path, obj = r.choice(objects)
        obj[r.choice(("extra", "num_page", "Type", "typo"))] = r.choice((1, "x", None))
        return doc, True, f"unknown key in {path}"
    if what == "nested_schema":
        nested = [(p, v) for p, v in objects if p]
        path, obj = r.choice(nested)
        obj["schema"] = r.choice(("garbage", 2, None, [], 0, -1, 1.0, True))
        return doc, True, f"nested schema in {path}"
    if what == "schema":
        doc["schema"] = r.choice((2, 0, "1", None, 1.0, True, 2**64))
        return doc, True, "top schema"
    if what == "duplicate":
        lists = [(p, v) for p, v in paths if isinstance(v, list) and v]
        if lists:
            path, lst = r.choice(lists)
            lst.extend(copy.deepcopy(lst) * r.choice((1, 3)))
            return doc, False, f"duplicate {path}"
    if what == "swap_type":
        path, value = r.choice(paths)
        if isinstance(value, int) and not isinstance(value, bool):
            _set(doc, path, r.choice((str(value), float(value) + 0.5, [value], {"v": value}, None)))
            return doc, True, f"int -> other type at {path}"
    key = {"tp": "tp", "heads": "num_kv_heads", "pages": "num_pages"}.get(what, "tp")
    hits = [(p, v) for p, v in paths if p[-1] == key]
    if hits:
        path, _ = r.choice(hits)
        _set(doc, path, r.choice((2**40, 2**47 + 1, 2**48, 3, 65537, 2**17)))
        return doc, False, f"{key} at {path}"
    return doc, False, "none"


def _render(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, indent=1)
    text = text.replace('"@@HUGE@@"', "9" * HUGE_DIGITS).replace('"@@NAN@@"', "NaN")
    return text.replace('"@@DEEP@@"', "[" * 100_000 + "]" * 100_000)


def _mutate_text(r: random.Random, text: str) -> tuple[bytes, bool, str]:
    data = text.encode()
    what = r.choice(("truncate", "flip", "insert", "deep", "bom", "nul", "big", "latin1"))
    if what == "truncate":
        return data[: r.randrange(len(data))], True, "truncate"
    if what == "flip":
        b = bytearray(data)
        for _ in range(r.randint(1, 4)):
            b[r.randrange(len(b))] = r.randrange(256)
        return bytes(b), False, "flip"
    if what == "insert":
        i = r.randrange(len(data))
        return data[:i] + r.choice((b"[", b"{", b'"', b"\\u0000", b"-", b"9" * 5000)) + data[i:], False, "insert"
    if what == "deep":
        n = r.choice((1000, 100_000, 1_000_000))
        return b"[" * n + b"]" * n, True, f"deep {n}"
    if what == "bom":
        return b"\xef\xbb\xbf" + data, False, "bom"
    if what == "nul":
        return data + b"\x00", True, "nul"
    if what == "big":
        return data[:-2] + b',"pad":"' + b"x" * r.choice((1 << 20, 40 << 20)) + b'"}', True, "big"
    return data.decode().encode("latin-1", errors="replace") + b"\xff", True, "latin1"


def pair_file_case(r: random.Random) -> tuple[bytes, bool, str]:
    """A pair file (bytes) mutated from a valid one; must it be rejected; what was done."""
    from kvgeom.tools import pair_file_dict

    pair, req = small_pair(r)
    doc = pair_file_dict(pair, req if r.random() < 0.8 else None)
    if r.random() < 0.75:
        doc, must, what = _mutate_doc(r, doc)
        return _render(doc).encode(), must, what
    return _mutate_text(r, _render(doc))


def run_pair_file(data: bytes, must_reject: bool, label: str, *, measure: bool = True,
                  folder: str | None = None) -> Outcome:
    """load_pair_file, then (accepted) plan it and judge the plan."""
    from kvgeom import fresh_request, plan_pair
    from kvgeom.tools import load_pair_file

    with tempfile.NamedTemporaryFile("wb", suffix=".json", dir=folder, delete=False) as f:
        f.write(data)
        path = f.name

    def call() -> Any:
        pair, req = load_pair_file(path)
        if req is None:
            req = fresh_request(pair, 32)
        return pair, req, plan_pair(pair, req, strategy="auto")

    try:
        return classify(Case(label, call, lambda out: plan_wrong(*out), must_reject), measure=measure, twice=True)
    finally:
        os.unlink(path)


# ---- campaign: the command line ------------------------------------------------------------------------


def cli_case(r: random.Random) -> tuple[list[str], bytes | None, bool, str]:
    """(argv with ``{file}`` for the pair file, the file's bytes or None, must it exit 2, what)."""
    what = r.random()
    if what < 0.75:
        data, must, label = pair_file_case(r)
        extra = r.choice(([], ["--strategy", "auto"], ["--strategy", "packed"], ["--json"], ["--tokens", "64"]))
        return ["plan", "--pair", "{file}", *extra], data, must, label
    flag = r.choice(("tokens", "layers", "pair-dev", "svg", "timeout", "prefix", "staging", "transfer-tokens"))
    if flag == "staging":
        n, tokens = r.choice((("1", "100"), ("0", "100"), ("-1", "100"), ("x", "100"), ("99999999999999999999", "100"),
                              ("4096", "100000"), ("1048576", "1000000")))
        strategy = r.choice(("packed", "auto"))
        must = n in ("-1", "x", "99999999999999999999") or (strategy == "packed" and n in ("0", "1"))
        return ["plan", "--strategy", strategy, "--staging-bytes", n, "--tokens", tokens], None, must, \
            f"--strategy {strategy} --staging-bytes {n} --tokens {tokens}"
    if flag == "tokens":
        n = r.choice(("100000000", "4294967296", "-5", "1e9", "0", "300000000000000"))
        return ["plan", "--tokens", n, "--preset", r.choice(("gqa-tp2-tp4", "llama3-70b-tp8-tp4"))], None, \
            n in ("-5", "1e9", "0"), f"--tokens {n}"
    if flag == "layers":
        n = r.choice(("100000", "1000000000", "0", "-1"))
        return ["plan", "--layers", n], None, n in ("0", "-1"), f"--layers {n}"
    if flag == "pair-dev":
        dev = r.choice(("/dev/zero", "/dev/urandom", "/dev/null", "/tmp", "/nonexistent/x.json"))
        return ["plan", "--pair", dev], None, True, f"--pair {dev}"
    if flag == "svg":
        target = r.choice(("/dev/full", "/tmp", "/proc/version", "/nonexistent/x.svg"))
        return ["plan", "--svg", target], None, True, f"--svg {target}"
    if flag == "timeout":
        t = r.choice(("nan", "0", "-1", "inf", "-inf", "1e-300"))
        return ["transfer", "--timeout", t], None, t != "1e-300", f"--timeout {t}"
    if flag == "prefix":
        s = r.choice(("17", "-16", "99999999999"))
        return ["plan", "--prefix", s], None, True, f"--prefix {s}"
    n = r.choice(("100000000", "10000000"))
    return ["transfer", "--tokens", n], None, False, f"transfer --tokens {n}"


def run_cli(argv: list[str], data: bytes | None, must_exit_2: bool, label: str, *, hang_s: float = HANG_S,
            folder: str | None = None) -> Outcome:
    """Run ``kvgeom ARGV`` in a child process (data capped); classify its exit status and output."""
    path = None
    if data is not None:
        with tempfile.NamedTemporaryFile("wb", suffix=".json", dir=folder, delete=False) as f:
            f.write(data)
            path = f.name
    args = [a.replace("{file}", path or "") for a in argv]
    stats = tempfile.NamedTemporaryFile("w", suffix=".stats", dir=folder, delete=False)
    stats.close()
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN", UCX_NET_DEVICES="lo")
    cmd = [sys.executable, "-m", "benchmarks.hostile", "--cli-child", stats.name, "--", *args]
    root = str(Path(__file__).resolve().parents[1])
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=hang_s, cwd=root, env=env,  # noqa: S603
                              preexec_fn=_limit_data)
    except subprocess.TimeoutExpired:
        return Outcome("hang", hang_s * 1e3, 0.0, "no exit within the hang limit", label=label)
    finally:
        if path:
            os.unlink(path)
    try:
        st = json.loads(Path(stats.name).read_text() or "{}")
    except ValueError:
        st = {}
    finally:
        os.unlink(stats.name)
    ms, mb = float(st.get("ms", 0.0)), float(st.get("mb", 0.0))
    err = proc.stderr.decode(errors="replace")
    out = proc.stdout.decode(errors="replace")
    tracebacks = err.count("Traceback")
    rc = proc.returncode
    if rc == 2 and not tracebacks:
        return Outcome("typed", ms, mb, err.strip().splitlines()[-1][:300] if err.strip() else "", label=label)
    if rc == 0 and not must_exit_2:
        return Outcome("ok", ms, mb, label=label)
    if rc == 0:
        return Outcome("wrong", ms, mb, "exit 0 for input that must be refused", label=label)
    if rc == 1 and "transfer FAILED:" in out:  # kvgeom transfer: the transfer itself failed (a 1e-300 s timeout)
        return Outcome("failed", ms, mb, out.split("transfer FAILED:", 1)[1].splitlines()[0][:300], label=label)
    if rc == 1 and "verdict: FAILED" in out:
        return Outcome("wrong", ms, mb, "a plan the simulator rejects", label=label)
    tail = (err.strip().splitlines() or ["?"])[-1]
    return Outcome("other", ms, mb, f"exit {rc}, {tracebacks} tracebacks: {tail[:300]}", label=label)


def _cli_child(stats_path: str, argv: list[str]) -> int:
    """In the child: run the CLI's main() timed; write {"ms", "mb"} to ``stats_path``, MB being the growth of
    the process's peak resident memory during main() (tracemalloc would slow the run it times)."""
    _limit_data()
    from kvgeom.tools.cli import main as cli_main

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        rc = cli_main(argv)
    finally:
        ms = (time.perf_counter() - t0) * 1e3
        mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        Path(stats_path).write_text(json.dumps({"ms": ms, "mb": mb}))
    return rc


# ---- campaigns through NIXL: handshakes and lying geometries -----------------------------------------


class NixlBench:
    """One honest P endpoint and one D endpoint (D's regions inside guard bytes), reused by every case."""

    GUARD = 4096

    def __init__(self, seed: int = 0) -> None:
        import torch

        from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair
        from kvgeom_nixl import Endpoint
        from kvgeom_nixl.agent import use_local_defaults
        from kvgeom_nixl.local import allocate_caches

        use_local_defaults()
        self.model = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 16)])
        self.P = EngineGeometry.build(self.model, tp=2, kernel_block_tokens=4, num_blocks=12, name="prefill")
        self.D = EngineGeometry.build(self.model, tp=1, kernel_block_tokens=8, num_blocks=12, layout="NHD",
                                      name="decode")
        self.pair = Pair(self.P, self.D)
        self.p_caches = allocate_caches(self.P)
        self.p = [Endpoint(self.P, "prefill", r, self.p_caches[r]) for r in range(self.P.tp)]
        self.honest = [e.handshake() for e in self.p]
        # D's regions live inside one buffer with GUARD bytes before, between and after them
        sizes = [reg.nbytes for reg in self.D.regions]
        total = sum(sizes) + self.GUARD * (len(sizes) + 1)
        self.d_buffer = torch.empty(total, dtype=torch.uint8)
        self.d_views: list[Any] = []
        off = self.GUARD
        for n in sizes:
            self.d_views.append(self.d_buffer[off:off + n])
            off += n + self.GUARD
        self.d = Endpoint(self.D, "decode", 0, self.d_views)
        self.p_links = [e.connect([self.d.handshake()], probe=False) for e in self.p]  # P answers D's messages
        self.rnd = np.random.default_rng(seed)
        from kvgeom_nixl.probe import prober

        prober().warm()  # started once per process: not part of any case's time

    def reset_d(self) -> None:
        """A new D endpoint (a new NIXL agent) over the same buffer: after a case poisoned the old one."""
        from kvgeom_nixl import Endpoint

        self.d.close()
        for link in self.p_links:
            link.close()
        self.d = Endpoint(self.D, "decode", 0, self.d_views)
        self.p_links = [e.connect([self.d.handshake()], probe=False) for e in self.p]

    def serve(self, request_id: str, timeout_s: float) -> list[Any]:
        """Every honest P rank holds its blocks for ``request_id`` (a direct pull, docs/design.md §8.1)."""
        return [link.hold(request_id, timeout_s=timeout_s) for link in self.p_links]

    def settle(self, holds: list[Any]) -> None:
        """End the holds of one case (cancelled if D never pulled) and drive every fence to its end."""
        for h in holds:
            h.cancel("closed", "case over")
        deadline = time.perf_counter() + 5
        while any(e.fencing or e.in_flight for e in self.p) and time.perf_counter() < deadline:
            for e in [*self.p, self.d]:
                e.progress()

    def fill_d(self) -> np.ndarray:
        """A fresh random pattern in all of D's buffer (guards included); returns a copy."""
        arr = self.d_buffer.numpy()
        arr[:] = self.rnd.integers(0, 256, arr.size, dtype=np.uint8)
        return arr.copy()

    def outside(self, before: np.ndarray, request: Any) -> int:
        """Bytes of D's buffer that changed outside the request's writable D pages."""
        from kvgeom.checking import writable_pages

        after = self.d_buffer.numpy()
        allowed = np.zeros(after.size, bool)
        if request is not None:
            masks = writable_pages(self.D, request)
            off = self.GUARD
            for ri, reg in enumerate(self.D.regions):
                m = masks.get(ri)
                if m is not None:
                    allowed[off:off + reg.nbytes] = np.repeat(m, reg.page_bytes)
                off += reg.nbytes + self.GUARD
        return int(((after != before) & ~allowed).sum())

    def honest_connects(self) -> bool:
        from kvgeom_nixl import HandshakeError

        try:
            link = self.d.connect(self.honest)
        except HandshakeError:
            return False
        link.close()
        return True

    def close(self) -> None:
        for e in [*self.p, self.d]:
            e.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def handshake_case(r: random.Random, honest: list[bytes]) -> tuple[list[bytes], str]:
    """The payloads of a peer engine with one payload mutated (bytes, JSON or NIXL metadata)."""
    payloads = list(honest)
    i = r.randrange(len(payloads))
    raw = payloads[i]
    what = r.choice(("json", "json", "json", "bytes", "metadata", "engine_size", "deep", "huge_int"))
    if what == "bytes":
        data, _, how = _mutate_text(r, raw.decode())
        payloads[i] = data
        return payloads, f"bytes: {how}"
    doc = json.loads(raw)
    if what == "metadata":
        md = base64.b64decode(doc["nixl_metadata"])
        how = r.choice(("truncate", "flip", "empty", "other_agent"))
        if how == "truncate":
            md = md[: r.randrange(1, len(md))]
        elif how == "flip":
            b = bytearray(md)
            b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            md = bytes(b)
        elif how == "empty":
            md = b"\x00"
        else:
            other = json.loads(honest[(i + 1) % len(honest)])
            md = base64.b64decode(other["nixl_metadata"])
        doc["nixl_metadata"] = _b64(md)
        payloads[i] = json.dumps(doc).encode()
        return payloads, f"metadata: {how}"
    if what == "engine_size":
        eng = doc["engine"]
        key, value = r.choice((("tp", 2**40), ("tp", 4), ("kernel_block_tokens", 2**30),
                               ("blocks_per_logical", 2**20),
                               ("topology", {"type": "Topology", "pp": 1, "partition": None, "dcp": 1,
                                             "interleave": 1, "replicas": 2**20}),
                               ("topology", {"type": "Topology", "pp": 2, "partition": None, "dcp": 2,
                                             "interleave": 1, "replicas": 1})))
        eng[key] = value
        if r.random() < 0.5:
            eng["model"]["groups"][0]["num_kv_heads"] = r.choice((2**47 + 1, 2**20, 6))
        if r.random() < 0.3:
            for reg in eng["regions"]:
                reg["num_pages"] = r.choice((2**40, 2**17, 65537))
        payloads[i] = json.dumps(doc).encode()
        return payloads, f"engine {key}={value}"
    if what == "deep":
        doc["engine"]["name"] = "@@DEEP@@"
        payloads[i] = _render(doc).encode()
        return payloads, "deep nesting"
    if what == "huge_int":
        doc[r.choice(("rank", "kvgeom_handshake"))] = "@@HUGE@@"
        payloads[i] = _render(doc).encode()
        return payloads, "huge integer"
    doc, _, how = _mutate_doc(r, doc)
    payloads[i] = _render(doc).encode()
    return payloads, f"json: {how}"


def run_handshake(bench: NixlBench, payloads: list[bytes], label: str, r: random.Random, *,
                  measure: bool = True) -> Outcome:
    """connect with the payloads; if it connects, pull a request from the (possibly lying) peer."""
    from kvgeom import fresh_request

    before = bench.fill_d()
    request_box: list[Any] = [None]
    connected: list[float] = []
    tokens = r.randint(1, 40)

    def call() -> Any:
        link = bench.d.connect(payloads)
        connected.append(time.perf_counter())
        try:
            pair = link.pair
            room = [min(eng.num_logical_blocks(g) for g in eng.group_regions(0)) - first
                    for eng, first in ((pair.prefill, 0), (pair.decode, 1))]
            cap = min(room[0] * pair.prefill.logical_block_tokens, room[1] * pair.decode.logical_block_tokens)
            request = fresh_request(pair, max(1, min(tokens, cap)), decode_first_block=1)
            request_box[0] = request
            holds = bench.serve("hs", 2.0)
            try:
                t = link.pull("hs", request, timeout_s=2.0)
                return t.wait(peers=bench.p)
            finally:
                bench.settle(holds)
        finally:
            link.close()

    t0 = time.perf_counter()
    out = classify(Case(label, call), measure=measure)
    if connected and out.kind != "ok":  # a pull's failure after an accepted handshake: not a handshake refusal
        out = attrs.evolve(out, ms=(t0 + out.ms / 1e3 - connected[0]) * 1e3)
    outside = bench.outside(before, request_box[0])
    if not bench.honest_connects():
        bench.reset_d()  # count this case once, not every case after it
        return attrs.evolve(out, kind="wrong", detail="an honest peer cannot connect after this case " + out.detail,
                            outside=outside)
    if outside:
        return attrs.evolve(out, kind="wrong", outside=outside)
    return out


def lying_case(r: random.Random, honest: list[bytes], P: Any) -> tuple[list[bytes], str]:
    """Payloads whose engine lies about P's geometry (a valid geometry, same model, other layout or sizes)
    with the memory entries sized for the lie."""
    from kvgeom import EngineGeometry
    from kvgeom.tools import to_dict

    tp = P.tp
    kw = {"tp": tp, "kernel_block_tokens": r.choice((1, 2, 4, 8, 16)), "num_blocks": r.choice((4, 12, 64, 2**10)),
          "blocks_per_logical": r.choice((1, 2)), "layout": r.choice(("HND", "NHD")),
          "kv": r.choice(("packed", "split", "inner")), "regions": r.choice(("per_layer", "interleaved"))}
    lie = EngineGeometry.build(P.model, name="prefill", **kw)
    out = []
    for raw in honest:
        doc = json.loads(raw)
        doc["engine"] = to_dict(lie)
        regs = doc["memory"]["regions"]
        addrs = [x["addr"] for x in regs]
        new = []
        for k, reg in enumerate(lie.regions):
            addr = addrs[k % len(addrs)] + r.choice((0, 0, 64, -64 if addrs[k % len(addrs)] > 64 else 0))
            new.append({"addr": addr, "nbytes": reg.nbytes, "device": 0})
        doc["memory"]["regions"] = new
        out.append(json.dumps(doc).encode())
    return out, f"lie {kw}"


# ---- the runner ----------------------------------------------------------------------------------------


def _limit_data(limit: int = DATA_LIMIT) -> None:
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard),
                                                  hard))


def _worker(conn: Any, name: str, seed: int, folder: str) -> None:
    _limit_data()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    bench = NixlBench(seed) if name in ("handshakes", "lying") else None
    while True:
        index = conn.recv()
        if index is None:
            break
        r = rng(name, seed, index)
        try:
            out = _one(name, r, bench, folder)
        except BaseException as e:  # noqa: BLE001 - a generator bug must not look like a hang
            out = Outcome("other", detail=f"harness: {type(e).__name__}: {_text(e)}")
        conn.send((index, attrs.asdict(out)))
    if bench is not None:
        bench.close()


def _one(name: str, r: random.Random, bench: NixlBench | None, folder: str) -> Outcome:
    if name == "api":
        return run_api(r)
    if name == "files":
        data, must, label = pair_file_case(r)
        return run_pair_file(data, must, label, folder=folder)
    if name == "handshakes" and bench is not None:
        payloads, label = handshake_case(r, bench.honest)
        return run_handshake(bench, payloads, label, r)
    if name == "lying" and bench is not None:
        payloads, label = lying_case(r, bench.honest, bench.P)
        return run_handshake(bench, payloads, label, r)
    raise ValueError(f"no in-worker campaign {_r(name)}")


@attrs.define
class Tally:
    """The counts of one campaign."""

    name: str
    tried: int = 0
    counts: dict[str, int] = attrs.field(factory=lambda: {k: 0 for k in KINDS})
    outside: int = 0
    max_ms: float = 0.0
    max_mb: float = 0.0
    max_ms_label: str = ""
    max_mb_label: str = ""
    over_ms: int = 0  # refusals slower than GOAL_MS
    over_mb: int = 0  # refusals larger than GOAL_MB
    seconds: float = 0.0
    examples: dict[str, list[str]] = attrs.field(factory=dict)

    def add(self, index: int, out: Outcome) -> None:
        self.tried += 1
        self.counts[out.kind] += 1
        self.outside += out.outside
        if out.kind == "typed":
            self.over_ms += out.ms >= GOAL_MS
            self.over_mb += out.mb >= GOAL_MB
            if out.ms > self.max_ms:
                self.max_ms, self.max_ms_label = out.ms, f"#{index} {out.label}"[:160]
            if out.mb > self.max_mb:
                self.max_mb, self.max_mb_label = out.mb, f"#{index} {out.label}"[:160]
        if out.kind in ("other", "hang", "wrong"):
            ex = self.examples.setdefault(out.kind, [])
            if len(ex) < 8:
                ex.append(f"#{index} {out.label[:120]}: {out.detail[:240]}")

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def campaign(name: str, count: int, *, seed: int = 0, jobs: int = 1, hang_s: float = HANG_S,
             progress: Callable[[str], None] = lambda _: None, start: int = 0) -> Tally:
    """Run ``count`` cases of campaign ``name`` (indices ``start..start+count-1``) and tally them."""
    tally = Tally(name)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvgeom-hostile-") as folder:
        if name == "cli":
            _run_cli_campaign(tally, count, seed, jobs, hang_s, folder, progress, start)
        else:
            _run_workers(tally, name, count, seed, jobs, hang_s, folder, progress, start)
    tally.seconds = time.perf_counter() - t0
    return tally


def _run_cli_campaign(tally: Tally, count: int, seed: int, jobs: int, hang_s: float, folder: str,
                      progress: Callable[[str], None], start: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, Outcome]:
        argv, data, must, label = cli_case(rng("cli", seed, i))
        return i, run_cli(argv, data, must, f"{' '.join(argv)} [{label}]", hang_s=hang_s, folder=folder)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for n, (i, out) in enumerate(pool.map(one, range(start, start + count))):
            tally.add(i, out)
            if n % 50 == 0:
                progress(f"cli: {n + 1}/{count}")


def _run_workers(tally: Tally, name: str, count: int, seed: int, jobs: int, hang_s: float, folder: str,
                 progress: Callable[[str], None], start: int) -> None:
    ctx = mp.get_context("spawn")
    todo = list(range(start, start + count))[::-1]
    workers: list[dict[str, Any]] = []

    def spawn() -> dict[str, Any]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, name, seed, folder), daemon=True)
        proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "index": None, "since": 0.0, "ready": False}

    def give(w: dict[str, Any]) -> None:
        if todo:
            w["index"] = todo.pop()
            w["since"] = time.perf_counter()
            w["conn"].send(w["index"])
        else:
            w["index"] = None

    for _ in range(max(1, jobs)):
        w = spawn()
        workers.append(w)
        give(w)
    done = 0
    last = time.perf_counter()
    startup = 120.0  # a fresh worker imports torch and makes NIXL agents before its first answer
    while any(w["index"] is not None for w in workers):
        for k, w in enumerate(workers):
            if w["index"] is None:
                continue
            limit = hang_s + (0 if w["ready"] else startup)
            if w["conn"].poll(0.01):
                try:
                    index, out = w["conn"].recv()
                except (EOFError, OSError):
                    out = attrs.asdict(Outcome("other", detail="worker died"))
                    index = w["index"]
                    w["proc"].join(1)
                    tally.add(index, Outcome(**out))
                    done += 1
                    workers[k] = spawn()
                    give(workers[k])
                    continue
                w["ready"] = True
                tally.add(index, Outcome(**out))
                done += 1
                give(w)
            elif not w["proc"].is_alive():
                tally.add(w["index"], Outcome("other", detail=f"worker died (exit {w['proc'].exitcode})",
                                              label=str(w["index"])))
                done += 1
                workers[k] = spawn()
                give(workers[k])
            elif time.perf_counter() - w["since"] > limit:
                w["proc"].kill()
                w["proc"].join(5)
                r = rng(name, seed, w["index"])
                label = _label_of(name, r)
                tally.add(w["index"], Outcome("hang", limit * 1e3, 0.0, f"no answer in {limit:.0f} s", label=label))
                done += 1
                workers[k] = spawn()
                give(workers[k])
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            progress(f"{name}: {done}/{len(todo) + done + sum(w['index'] is not None for w in workers)}")
    for w in workers:
        with contextlib.suppress(Exception):
            w["conn"].send(None)
        w["proc"].join(10)
        if w["proc"].is_alive():
            w["proc"].kill()


def _label_of(name: str, r: random.Random) -> str:
    """The label of a case without running it (for a hang)."""
    try:
        if name == "api":
            return api_case(r).label
        if name == "files":
            return pair_file_case(r)[2]
    except Exception as e:  # noqa: BLE001
        return f"(label: {type(e).__name__})"
    return name


# ---- the table -----------------------------------------------------------------------------------------

ROW_NAMES = {"api": "API values (pairable, plan_transfer, constructors)", "files": "pair files, in process",
             "cli": "kvgeom plan --pair / hostile flags", "handshakes": "mutated handshakes (real NIXL)",
             "lying": "lying geometries pulled (real NIXL)"}


def render(tallies: Sequence[Tally], *, title: str = "") -> str:
    head = ["input", "tried", "ok", "typed", "transfer failed", "other", "hang", "wrong", "bytes outside D",
            "max refusal ms", "max refusal MB", f"refusals >= {GOAL_MS:.0f} ms"]
    rows = [head]
    for t in tallies:
        rows.append([ROW_NAMES.get(t.name, t.name), f"{t.tried:,}", f"{t.counts['ok']:,}", f"{t.counts['typed']:,}",
                     f"{t.counts['failed']:,}", f"{t.counts['other']:,}", f"{t.counts['hang']:,}",
                     f"{t.counts['wrong']:,}", f"{t.outside:,}", f"{t.max_ms:.1f}", f"{t.max_mb:.1f}",
                     f"{t.over_ms:,}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [title] if title else []
    for k, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                        enumerate(zip(row, widths))) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    met = all(t.counts["other"] == t.counts["hang"] == t.counts["wrong"] == t.outside == 0
              and t.max_ms < GOAL_MS and t.max_mb < GOAL_MB for t in tallies)
    lines.append(f"goal (0 other, 0 hang, 0 wrong, 0 bytes outside D, refusals < {GOAL_MS:.0f} ms and "
                 f"< {GOAL_MB:.0f} MB): {'met' if met else 'NOT met'}")
    for t in tallies:
        lines.append(f"  {t.name}: {t.seconds:.0f} s; slowest refusal {t.max_ms:.1f} ms ({t.max_ms_label}); "
                     f"largest {t.max_mb:.1f} MB ({t.max_mb_label})")
        for kind, ex in t.examples.items():
            for e in ex:
                lines.append(f"    {kind}: {e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--cli-child"]:
        stats, rest = args_list[1], args_list[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return _cli_child(stats, rest)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(CAMPAIGNS), help="campaigns, comma-separated")
    parser.add_argument("--count", action="append", default=[], metavar="NAME=N", help="cases of one campaign")
    parser.add_argument("--quick", action="store_true", help="1/100 of the issue's counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes per campaign")
    parser.add_argument("--hang-s", type=float, default=HANG_S)
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the tallies as JSON")
    parser.add_argument("--case", default=None, metavar="NAME:INDEX", help="run one case in this process, verbose")
    args = parser.parse_args(args_list)
    if args.case:
        name, index = args.case.split(":")
        r = rng(name, args.seed, int(index))
        bench = NixlBench(args.seed) if name in ("handshakes", "lying") else None
        if name == "cli":
            argv_, data, must, label = cli_case(r)
            print(label, argv_)
            print(run_cli(argv_, data, must, label))
        else:
            print(_one(name, r, bench, tempfile.gettempdir()))
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    counts = {k: (max(1, v // 100) if args.quick else v) for k, v in ISSUE_COUNTS.items()}
    for item in args.count:
        k, v = item.split("=")
        counts[k] = int(v)
    tallies = []
    for name in only:
        def progress(line: str) -> None:
            print(f"[hostile] {line}", file=sys.stderr, flush=True)

        progress(f"{name}: {counts[name]} cases, {args.jobs} jobs")
        tallies.append(campaign(name, counts[name], seed=args.seed, jobs=args.jobs, hang_s=args.hang_s,
                                progress=progress))
        print(render(tallies[-1:]), flush=True)
    print(render(tallies, title=f"hostile-input campaigns (seed {args.seed})"))
    if args.json:
        Path(args.json).write_text(json.dumps([t.as_dict() for t in tallies], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
