"""Planning speed of two checkouts side by side, in one run: ``python -m benchmarks.plan_compare
BEFORE_TREE AFTER_TREE [--rounds N] [--only plan]``.

Each round runs ``python -m benchmarks --only plan --quick --json`` in the BEFORE tree, then in the
AFTER tree (each a subprocess importing its own kvgeom), alternating so that load changes on the
shared machine hit both; the table gives each timed row's median over the rounds and the ratio
after / before (1.00 = unchanged). Rows whose unit is not seconds (ratios, exponents, counts) are
left out. Used for docs/design.md §3.5's claim that per-plane layouts left plain planning as fast.

Worked number: a row at 0.0123 s before and 0.0125 s after reads ``1.02``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def one_run(tree: Path, only: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--only", only, "--quick", "--json", "--no-progress"],
                          cwd=tree, capture_output=True, text=True, check=True, timeout=1800)
    rows = json.loads(proc.stdout)
    return {str(r["name"]): float(r["value"]) for r in rows if r.get("unit") == "s"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="plan")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        runs["before"].append(one_run(args.before, args.only))
        runs["after"].append(one_run(args.after, args.only))
    names = [n for n in runs["before"][0] if all(n in r for r in runs["before"] + runs["after"])]
    print("| row | before (s) | after (s) | after / before |\n|---|---|---|---|")
    ratios = []
    for n in names:
        b = statistics.median(r[n] for r in runs["before"])
        a = statistics.median(r[n] for r in runs["after"])
        ratios.append(a / b if b else 1.0)
        print(f"| {n} | {b:.4g} | {a:.4g} | {ratios[-1]:.2f} |")
    print(f"\n{len(names)} rows, {args.rounds} rounds each; geometric mean of after / before: "
          f"{statistics.geometric_mean(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
