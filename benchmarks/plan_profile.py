"""Where planning time goes: ``python -m benchmarks.plan_profile CASE TOKENS [--top N] [--sort tottime|cumulative]
[--path compiled|reference] [--pattern fresh|scattered]``.

    build_case(CASE, TOKENS) --> compile --> one warm-up plan --> cProfile over ``--repeats`` plans --> top N entries

CASE is a synthetic pair or a preset (``python -m benchmarks.plan_profile --list``); the strategy is the
case's own (``syn-nhd-hnd-staged`` plans staged, everything else direct). ``--path`` picks the
compiled planner (the default) or the reference one, ``--pattern`` fresh or scattered block ids.

Worked number: ``python -m benchmarks.plan_profile llama3-70b-tp8-tp4 16384 --top 15`` profiles plans of
1,310,720 copy rows and prints the 15 functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom import plan_reference

from .cases import build_case, case_names, pattern_request


def profile_plan(name: str, tokens: int, *, repeats: int = 3, top: int = 20, sort: str = "tottime",
                 path: str = "compiled", pattern: str = "fresh") -> str:
    """The cProfile table of ``repeats`` plans of ``name`` at ``tokens`` computed tokens."""
    case = build_case(name, tokens, pool_factor=2.0)
    request = case.fresh() if pattern == "fresh" else pattern_request(case, pattern, np.random.default_rng(0))
    compiled = case.pair.compile()

    def plan_once() -> Any:
        if path == "reference":
            return plan_reference(case.pair, request, strategy=case.strategy)  # type: ignore[arg-type]
        return compiled.plan(request, strategy=case.strategy)  # type: ignore[arg-type]

    plan = plan_once()
    head = (f"{name} M={tokens} {pattern} {path} strategy={case.strategy}: {len(plan.copies)} copies, "
            f"{len(plan.zeros)} zeros, {plan.copies_before_coalescing} rows before coalescing\n")
    del plan
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(repeats):
        plan_once()
    prof.disable()
    head += f"{(time.perf_counter() - t0) / repeats * 1e3:.1f} ms per plan under the profiler\n"
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(sort).print_stats(top)
    return head + buf.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_profile", description="profile planning of one case")
    parser.add_argument("case", nargs="?", help="a synthetic pair or preset name")
    parser.add_argument("tokens", nargs="?", type=int, default=16384, help="computed tokens M (default 16384)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--sort", choices=("tottime", "cumulative"), default="tottime")
    parser.add_argument("--path", choices=("compiled", "reference"), default="compiled")
    parser.add_argument("--pattern", choices=("fresh", "scattered"), default="fresh")
    parser.add_argument("--list", action="store_true", help="list the case names")
    args = parser.parse_args(argv)
    if args.list or not args.case:
        print("\n".join(case_names()))
        return 0 if args.list else 2
    if args.case not in case_names():
        print(f"unknown case {args.case!r}; --list shows them", file=sys.stderr)
        return 2
    print(profile_plan(args.case, args.tokens, repeats=args.repeats, top=args.top, sort=args.sort, path=args.path,
                       pattern=args.pattern))
    return 0


if __name__ == "__main__":
    sys.exit(main())
