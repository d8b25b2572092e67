"""The first ``connect`` of a process, before and after the prober starts in the background (same run).

    python -m benchmarks.connect            # 5 fresh processes per cell, alternating, medians
    python -m benchmarks.connect --repeats 3 --json

Every metadata blob is loaded first in a prober process (``kvgeom_nixl.probe``, docs/design.md §14),
started once per process. Before, the first ``Endpoint.connect`` started it and waited for it (a
Python process that imports NIXL and makes a UCX agent); now an ``Endpoint`` starts it in a
background thread when it is made (``warm_prober=True``, the default), so the first connect finds it
ready, or waits only for what is left. Each measurement is a fresh Python process (the prober is one
per process): a P and a D endpoint, an optional gap (the time an engine spends between registering
its cache and its first request), then the D endpoint's first ``connect`` to P's handshake, timed.

Worked number: if starting the prober takes 0.6 s and the gap is 1 s, the first connect costs
about 0.6 s before and about 1 ms (one probe) after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["first_connect", "main"]

_ONE = """
import sys, time
from kvgeom import AttentionSpec, EngineGeometry, ModelSpec
from kvgeom_nixl import Endpoint
from kvgeom_nixl.local import allocate_caches
warm, gap = sys.argv[1] == "after", float(sys.argv[2])
m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
p_eng = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="prefill")
d_eng = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode")
p = Endpoint(p_eng, "prefill", 0, allocate_caches(p_eng)[0], warm_prober=False)
d = Endpoint(d_eng, "decode", 0, allocate_caches(d_eng)[0], warm_prober=warm)
time.sleep(gap)
payload = p.handshake()
t0 = time.perf_counter()
d.connect([payload])
print((time.perf_counter() - t0) * 1e3)
"""


def first_connect(repeats: int = 5, gaps: Sequence[float] = (0.0, 1.0)) -> dict[str, dict[str, float]]:
    """Median ms of the first connect per (gap, before | after), fresh processes, alternating."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("UCX_NET_DEVICES", "lo")
    out: dict[str, dict[str, list[float]]] = {f"gap {g:g} s": {"before": [], "after": []} for g in gaps}
    for _ in range(repeats):
        for g in gaps:
            for mode in ("before", "after"):
                res = subprocess.run([sys.executable, "-c", _ONE, mode, str(g)], capture_output=True, text=True,
                                     timeout=300, env=env, cwd=root, check=True)
                out[f"gap {g:g} s"][mode].append(float(res.stdout.strip().splitlines()[-1]))
    return {k: {m: statistics.median(v) for m, v in modes.items()} for k, modes in out.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.connect", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    res = first_connect(args.repeats)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'first connect (ms, median of ' + str(args.repeats) + ')':<40} {'before':>8} {'after':>8}")
    for cell, v in res.items():
        print(f"{cell:<40} {v['before']:>8.1f} {v['after']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
