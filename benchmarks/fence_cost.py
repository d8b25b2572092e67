"""The executor at another git revision next to this one, in one process: the latency cost of a change.

    python -m benchmarks.transfer --baseline 749dd83^1     # the executor before issue 19's fences
    python -m benchmarks.fence_cost 749dd83^1 --repeats 40 --json

``git archive <rev> kvgeom_nixl`` is unpacked into a temporary directory as the package
``kvgeom_nixl_baseline`` (its imports are relative, and it uses this checkout's planner, which is
what it ran with), so both executors live in this process side by side: each gets its own
``LocalDeployment`` (one NIXL agent per rank) of the same pair over its own caches, filled by the
simulator. Every case runs a few times untimed (UCX wire-up), then the two executors alternate,
``before, after, after, before, ...``, ``repeats`` times each; the medians are reported, with the
notifications each whole transfer delivered (every rank's ``get_new_notifs``, counted on the bare
NIXL agents: the protocol's messages and NIXL's completion notifications).

Cases (P TP2 -> D TP1 unless said): a whole direct pull (D pulls, both P ranks serve) and push, of
100 KiB and 4 MiB; a packed pull of 100 KiB, P TP1 -> D TP2 (each chunk goes to 2 D ranks: since
issue 19 it asks them one after the other).

Round trips on D's path, from the protocols (docs/design.md §8.1): before, a pull posted its READs
at once and was done when they finished (P learned of it from NIXL's notification); now D first
asks P (``req``, ``grant``: one round trip) and is done on P's ``held``, answered to the READ's
notification (one more): 2 round trips more, and D's ``acked`` ends P. A push now waits for D's
``req`` before its WRITE and ends on D's ``acked``.

Worked number: a 100 KiB pull of 1.13 ms before and 1.35 ms after is +0.22 ms (1.19x); with 60 us
notification round trips that is about the 2 round trips plus the bookkeeping of 6 more messages.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["load_baseline", "compare", "render", "main", "CASES"]

CASES = ("pull 100 KiB", "push 100 KiB", "pull 4 MiB", "push 4 MiB", "packed pull 100 KiB, P TP1 -> D TP2")


def load_baseline(rev: str, root: str | None = None) -> tuple[ModuleType, str, str]:
    """``kvgeom_nixl`` at git revision ``rev`` as the package ``kvgeom_nixl_baseline``, the commit,
    and the temporary directory it lives in (the caller removes it)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sha = subprocess.run(["git", "-C", root, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="kvgeom-baseline-")
    archive = subprocess.run(["git", "-C", root, "archive", sha, "kvgeom_nixl"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
    shutil.rmtree(os.path.join(tmp, "kvgeom_nixl", "vllm"), ignore_errors=True)  # not needed, imports vLLM
    os.rename(os.path.join(tmp, "kvgeom_nixl"), os.path.join(tmp, "kvgeom_nixl_baseline"))
    sys.path.insert(0, tmp)
    importlib.invalidate_caches()
    module = importlib.import_module("kvgeom_nixl_baseline")
    importlib.import_module("kvgeom_nixl_baseline.local")
    return module, sha, tmp


def _count_notifications(dep: Any) -> list[int]:
    """Wrap every rank's bare NIXL agent so that delivered notifications are counted in the list."""
    counter = [0]
    for ep in dep.endpoints:
        nixl = ep.rank_agent.nixl
        get = nixl.get_new_notifs

        def counted(_get: Callable[[], Any] = get) -> Any:
            got = _get()
            counter[0] += sum(len(v) for v in got.values())
            return got

        nixl.get_new_notifs = counted
    return counter


def _case(name: str) -> tuple[Any, Any, Any, bool, int]:
    """(pair, request, plan, push, staging bytes) of one case."""
    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request, plan_pair
    from kvgeom_nixl.local import slot_bytes_for

    push = name.startswith("push")
    if name.startswith("packed"):
        m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
        pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                    EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="decode", layout="NHD"))
        request = fresh_request(pair, 50, prefill_first_block=1, decode_first_block=2)
        plan = pair.plan(request, strategy="packed", staging_bytes=1 << 20)
        return pair, request, plan, False, slot_bytes_for(plan)
    tokens = 50 if "100 KiB" in name else 2048  # x 2 layers x K, V x 4 heads x 128 B: 100 KiB or 4 MiB
    blocks = -(-tokens // 16) + 8
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
    pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=blocks, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=blocks, name="decode"))
    request = fresh_request(pair, tokens, prefill_first_block=1, decode_first_block=4)
    return pair, request, plan_pair(pair, request), push, 0


def compare(rev: str, repeats: int = 40, cases: Sequence[str] = CASES, warmup: int = 5,
            progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Medians (ms) and notifications per transfer of every case, before (``rev``) and after (this tree)."""
    from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches

    base, sha, tmp = load_baseline(rev)
    try:
        out: dict[str, Any] = {"baseline": rev, "baseline_commit": sha, "repeats": repeats, "cases": {}}
        for name in cases:
            progress(f"fence cost: {name}")
            pair, request, plan, push, slot = _case(name)
            deps: dict[str, Any] = {}
            caches: dict[str, Any] = {}
            for key, local in (("before", base.local), ("after", sys.modules["kvgeom_nixl.local"])):
                p, d = allocate_caches(pair.prefill), allocate_caches(pair.decode)
                fill_caches(pair, request, p, d)
                deps[key] = local.LocalDeployment(pair, p, d, staging_bytes=slot) if key == "before" else \
                    LocalDeployment(pair, p, d, staging_bytes=slot)
                caches[key] = d
            counters = {k: _count_notifications(dep) for k, dep in deps.items()}
            times: dict[str, list[float]] = {"before": [], "after": []}
            d_times: dict[str, list[float]] = {"before": [], "after": []}  # D's own wall time, post to done
            notes: dict[str, list[int]] = {"before": [], "after": []}
            try:
                for i in range(warmup + repeats):
                    order = ("before", "after") if i % 2 == 0 else ("after", "before")
                    for key in order:
                        n0 = counters[key][0]
                        t0 = time.perf_counter()
                        results = deps[key].run(f"{key}-{i}", request, plan, push=push, timeout_s=30)
                        dt = time.perf_counter() - t0
                        if i >= warmup:
                            times[key].append(dt)
                            d_times[key].append(max(r.wall_s for r in results if r.role == "decode"))
                            for _ in range(50):  # messages still on their way (P's acked, ended) count too
                                for ep in deps[key].endpoints:
                                    ep.progress()
                            notes[key].append(counters[key][0] - n0)
                wrong = {k: len(check_caches(pair, request, caches[k])[0]) for k in caches}
            finally:
                for dep in deps.values():
                    dep.close()
            out["cases"][name] = {
                "bytes": int(plan.bytes_copied),
                **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
                **{f"{k}_d_ms": statistics.median(v) * 1e3 for k, v in d_times.items()},
                **{f"{k}_p90_ms": sorted(v)[int(0.9 * (len(v) - 1))] * 1e3 for k, v in times.items()},
                **{f"{k}_notifications": statistics.median(v) for k, v in notes.items()},
                "wrong_bytes_checks": wrong,
            }
        return out
    finally:
        for mod in [m for m in sys.modules if m == "kvgeom_nixl_baseline" or m.startswith("kvgeom_nixl_baseline.")]:
            del sys.modules[mod]
        if tmp in sys.path:
            sys.path.remove(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def render(res: dict[str, Any]) -> str:
    head = f"{'case (in process)':<38} {'bytes':>9} | {'whole: before':>13} {'after':>7} {'ratio':>5} | " \
           f"{'D: before':>9} {'after':>7} {'ratio':>5} | {'notifications':>13} {'after':>5}"
    lines = [f"executor before: {res['baseline']} ({res['baseline_commit'][:10]}), after: this tree; ms, "
             f"medians of {res['repeats']} interleaved runs each (whole: every rank done; D: the D rank's "
             f"transfer, post to done)", head, "-" * len(head)]
    for name, c in res["cases"].items():
        lines.append(f"{name:<38} {c['bytes']:>9} | {c['before_ms']:>13.3f} {c['after_ms']:>7.3f} "
                     f"{c['after_ms'] / c['before_ms']:>5.2f} | {c['before_d_ms']:>9.3f} {c['after_d_ms']:>7.3f} "
                     f"{c['after_d_ms'] / c['before_d_ms']:>5.2f} | {c['before_notifications']:>13.0f} "
                     f"{c['after_notifications']:>5.0f}")
    lines.append("round trips on D's path (docs/design.md §8.1): pull +2 (req/grant before the READ, held after it); "
                 "push: P waits for D's req, ends on D's acked")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fence_cost", description=__doc__.split("\n")[0])
    parser.add_argument("baseline", help="the git revision of the executor to compare with (e.g. 749dd83^1)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    res = compare(args.baseline, args.repeats, progress=lambda line: print(f"[bench] {line}", file=sys.stderr))
    print(json.dumps(res) if args.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
