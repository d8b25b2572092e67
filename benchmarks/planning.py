"""Planning time per request against writing the plan's output once, its growth, its peak memory.

    pair built once ----> pair.plan(request, strategy)      timed (coalescing and zeros included)
                    \\---> lower bound: numpy allocates and fills the plan's output columns once,
                          7 int64 arrays of len(plan.copies) + 4 of len(plan.zeros)
    ratio = plan time / lower bound         (goal: <= 3 at M >= 16k)
    exponent = slope of log(plan time) over log(M), least squares   (goal: <= 1.1, i.e. linear)

A second ratio, against writing the 7 columns of ``copies_before_coalescing`` rows, separates
"the planner does too much work" (many raw rows for a small coalesced plan) from "the planner is
slow per row".

Peak memory: ``tracemalloc`` around one plan at the largest size (numpy reports its buffers to
tracemalloc), next to the plan's own column bytes (56 B per copy row + 32 B per zero row).

Worked number: 1,310,720 copy rows and no zeros -> the lower bound writes 7 * 8 * 1,310,720 B =
70 MiB; at 10 ms for that and 131 ms to plan, the ratio is 13.1.
"""

from __future__ import annotations

import functools
import gc
import time
import tracemalloc

import numpy as np

from kvgeom import Request, TransferPlan

from .cases import Case, build_case
from .common import Config, Measurement, Progress, interleaved_medians, measurement, quiet

__all__ = ["write_columns", "run_planning", "run_memory", "fit_exponent"]

COPY_COLUMNS = 7
ZERO_COLUMNS = 4
PLAN_GOAL = "<= 3x the lower bound at M >= 16k"
EXPONENT_GOAL = "<= 1.1 (linear in tokens)"
EXPONENT_LIMIT = 1.1
RATIO_LIMIT = 3.0


def write_columns(copies: int, zeros: int) -> list[np.ndarray]:
    """Allocate and fill the output columns of a plan of this size once (all kept alive, as a plan's)."""
    cols = []
    for i in range(COPY_COLUMNS):
        a = np.empty(copies, np.int64)
        a.fill(i)
        cols.append(a)
    for i in range(ZERO_COLUMNS):
        a = np.empty(zeros, np.int64)
        a.fill(i)
        cols.append(a)
    return cols


def fit_exponent(tokens: list[int], seconds: list[float]) -> float:
    """Least-squares slope of log(seconds) over log(tokens)."""
    slope, _ = np.polyfit(np.log(np.asarray(tokens, float)), np.log(np.asarray(seconds, float)), 1)
    return float(slope)


def _plan(case: Case, request: Request) -> TransferPlan:
    return case.pair.plan(request, strategy=case.strategy)


def _output_bytes(plan: TransferPlan) -> int:
    return 8 * (COPY_COLUMNS * len(plan.copies) + ZERO_COLUMNS * len(plan.zeros))


def run_planning(config: Config, progress: Progress = quiet) -> list[Measurement]:
    out: list[Measurement] = []
    for name in config.plan_presets + config.plan_synthetic:
        sizes: list[int] = []
        times: list[float] = []
        for M in config.plan_tokens:
            case = build_case(name, M)
            request = case.fresh()
            reps = config.repeats_for(M)
            progress(f"plan {name} M={M} ({reps} repeats)")
            plan = _plan(case, request)  # warm-up, and the sizes of the lower bounds
            n, z, raw = len(plan.copies), len(plan.zeros), plan.copies_before_coalescing
            del plan
            gc.collect()
            med = interleaved_medians({
                "plan": functools.partial(_plan, case, request),
                "bound": functools.partial(write_columns, n, z),
                "raw": functools.partial(write_columns, raw, 0),
            }, reps)
            sizes.append(M)
            times.append(med["plan"])
            applies = M >= config.goal_tokens
            note = f"{n} copies, {z} zeros, {raw} rows before coalescing; strategy {case.strategy}"
            out.append(measurement("plan", f"plan/{name}/{M}", med["plan"], "s", med["bound"],
                                   "numpy writes the plan's 7+4 output columns once", goal=PLAN_GOAL,
                                   met=(med["plan"] <= RATIO_LIMIT * med["bound"]) if applies else None, note=note))
            out.append(measurement("plan", f"plan/{name}/{M}/vs-raw-rows", med["plan"], "s", med["raw"],
                                   "numpy writes 7 columns of the rows before coalescing",
                                   note=f"{raw} raw rows"))
        if len(sizes) >= 2:
            k = fit_exponent(sizes, times)
            out.append(measurement("plan", f"plan/{name}/exponent", k, "exponent", 1.0, "linear growth (exponent 1)",
                                   goal=EXPONENT_GOAL,
                                   met=(k <= EXPONENT_LIMIT) if max(sizes) >= config.goal_tokens else None,
                                   note="fit over M = " + ", ".join(str(s) for s in sizes)))
    return out


def run_memory(config: Config, progress: Progress = quiet) -> list[Measurement]:
    out: list[Measurement] = []
    M = config.memory_tokens
    for name in config.plan_presets + config.plan_synthetic:
        case = build_case(name, M)
        request = case.fresh()
        progress(f"memory {name} M={M}")
        gc.collect()
        tracemalloc.start()
        t0 = time.perf_counter()
        plan = _plan(case, request)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        size = _output_bytes(plan)
        mib = float(1 << 20)
        out.append(measurement("memory", f"memory/{name}/{M}", peak / mib, "MiB", max(size, 1) / mib,
                               "the plan's own columns (56 B/copy + 32 B/zero)",
                               note=f"{len(plan.copies)} copies, {len(plan.zeros)} zeros; "
                                    f"{elapsed:.2f} s under tracemalloc"))
        del plan
        gc.collect()
    return out
