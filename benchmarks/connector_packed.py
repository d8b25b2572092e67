"""Direct against packed pulls in kvgeom's vLLM connector, between CPU_ATTN block sizes (no vLLM).

    python -m benchmarks.connector_packed [--tokens 517 4096 16384] [--requests 10]

One P executor (blocks of 32 tokens) and two D executors (blocks of 64) in this process: the tiny
float32 Llama of ``python -m benchmarks.vllm_connector`` (2 layers, 4 KV heads x 32 dims, TP1,
CPU_ATTN pages, NIXL over UCX on 127.0.0.1). ``direct`` is D with no staging ring (``"staging_bytes":
0``: auto picks direct, a copy per K dim and P block), ``packed`` D and P with the rings
``staging_bytes_for`` sizes and packing weighed by its rows alone (``"packed_setup_ms": 0``: auto
packs, D offers P the request, P packs, one wire row, D unpacks), and ``auto`` the connector's
defaults (a 12 ms setup cost added to packing: direct for short prompts, packed for long ones).
Requests alternate between the two D executors with fresh block ids each time; every pull plans
(packed plans are not learnt as recipes, and a direct plan's first two requests of a shape plan too).

Per request: the pull's wall time (queued on D until D reports it), D's CPU in ``_start_pull``
(plan, offer, post; the jobs thread) and P's CPU packing (``run_steps``, P's progress thread). Medians of ``--requests`` after
one warm-up request per cell; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

__all__ = ["VARIANTS", "METRICS", "main", "measure", "render"]

VARIANTS = ("direct", "packed", "auto")
METRICS = ("wall", "d_cpu", "p_pack", "packed")
#: each D executor's options: no staging ring (direct), packing weighed by its rows alone (packed:
#: auto packs every one of these requests), and the connector's defaults (auto: a 12 ms setup cost)
OPTIONS: dict[str, dict[str, Any]] = {"direct": {"staging": False, "packed_setup_s": 0.0},
                                      "packed": {"staging": True, "packed_setup_s": 0.0},
                                      "auto": {"staging": True}}
HEADS, DIM, LAYERS, P_BLOCK, D_BLOCK = 4, 32, 2, 32, 64
WARMUP = 1


class _Clock:
    """D's ``_start_pull`` CPU and P's packing CPU, by P's request id."""

    def __init__(self) -> None:
        self.d_cpu: dict[str, float] = {}
        self.p_pack: dict[str, float] = {}
        self.lock = threading.Lock()

    def _start(self, cpu: float, ex: Any, job: Any) -> None:
        with self.lock:
            self.d_cpu[job.transfer_id] = cpu

    def _run(self, cpu: float, t: Any, ch: Any, pack: bool) -> None:
        if pack:
            with self.lock:
                self.p_pack[t.request_id] = self.p_pack.get(t.request_id, 0.0) + cpu

    def install(self) -> Callable[[], None]:
        """Wrap ``PullSide._start_pull`` and ``PackedTransfer._run``; returns the undo."""
        from benchmarks.common import thread_cpu_hook
        from kvgeom_nixl.packed import PackedTransfer
        from kvgeom_nixl.vllm.pulls import PullSide

        undos = [thread_cpu_hook(PullSide, "_start_pull", self._start), thread_cpu_hook(PackedTransfer, "_run", self._run)]

        def undo() -> None:
            for u in undos:
                u()
        return undo


def _caches(blocks: int, block: int, fill: float) -> dict[str, Any]:
    import torch

    per = blocks * HEADS * block * 2 * DIM
    buf = torch.full((LAYERS * per,), fill)
    return {f"model.layers.{i}.self_attn.attn": buf[i * per:(i + 1) * per].view(blocks, HEADS, block, 2 * DIM)
            for i in range(LAYERS)}


def measure(tokens: Sequence[int], requests: int, *, timeout_s: float = 120.0) -> dict[int, dict[str, dict[str, list[float]]]]:
    """Per prompt length, variant and metric, the kept requests' values (seconds; descriptors a count)."""
    from kvgeom_nixl import staging_bytes_for
    from kvgeom_nixl.testing import free_ports
    from kvgeom_nixl.vllm.caches import CacheGroup, geometry_from_kv_caches
    from kvgeom_nixl.vllm.executor import ConnectorExecutor, PullJob, ReleaseJob

    longest = max(tokens)
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))

    def group(block: int) -> CacheGroup:
        return CacheGroup("g0", "full", names, block, HEADS, None, {n: "CPU_ATTN" for n in names},
                          {n: "vec" for n in names})

    p_pool, d_pool = 3 * (longest // P_BLOCK + 2), 3 * (longest // D_BLOCK + 2)
    port = free_ports(1)
    p_geo, p_layers = geometry_from_kv_caches(_caches(p_pool, P_BLOCK, 1.0), [group(P_BLOCK)], tp=1, name="P")
    slot = staging_bytes_for(p_geo, 0, longest)
    p = ConnectorExecutor(p_geo, 0, 1, p_layers, engine_id="P", producer=True, consumer=False, port=port,
                          staging_bytes=slot)
    ds = {}
    for v in VARIANTS:
        geo, layers = geometry_from_kv_caches(_caches(d_pool, D_BLOCK, -7.0), [group(D_BLOCK)], tp=1, name=f"D-{v}")
        opts = {k: x for k, x in OPTIONS[v].items() if k != "staging"}
        ds[v] = ConnectorExecutor(geo, 0, 1, layers, engine_id=f"D-{v}", producer=False, consumer=True,
                                  staging_bytes=slot if OPTIONS[v]["staging"] else 0, **opts)
    clock = _Clock()
    undo = clock.install()
    out: dict[int, dict[str, dict[str, list[float]]]] = {m: {v: {k: [] for k in METRICS} for v in VARIANTS}
                                                         for m in tokens}
    rng = random.Random(7)
    packs: dict[str, int] = {}
    try:
        for m in tokens:
            n_p, n_d = -(-m // P_BLOCK), -(-m // D_BLOCK)
            for i in range(requests + WARMUP):
                for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
                    d = ds[v]
                    rid = f"{v}-{m}-{i}"
                    p0, d0 = rng.randrange(1, p_pool - n_p), rng.randrange(1, d_pool - n_d)
                    p.send(rid, 120.0)
                    t0 = time.perf_counter()
                    d.pull(PullJob(f"d-{rid}", rid, "P", m, 0, (tuple(range(p0, p0 + n_p)),),
                                   (tuple(range(d0, d0 + n_d)),), ReleaseJob(rid, "127.0.0.1", port, 1), 1))
                    deadline = time.monotonic() + timeout_s
                    while True:
                        r = d.take()
                        if r.finished_recving:
                            if r.failed:
                                raise RuntimeError(f"{rid} failed: {r.failed}")
                            break
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{rid}: no result in {timeout_s} s")
                        time.sleep(0.0005)
                    wall = time.perf_counter() - t0
                    time.sleep(0.005)
                    packed = d.counters().get("pulls packed", 0)
                    was_packed = packed > packs.get(v, 0)
                    packs[v] = packed
                    if v != "auto" and was_packed != (v == "packed"):
                        raise RuntimeError(f"the {v} D {'packed' if was_packed else 'did not pack'} {rid}: "
                                           "the variant measures the wrong path")
                    if i >= WARMUP:
                        cell = out[m][v]
                        cell["wall"].append(wall)
                        cell["d_cpu"].append(clock.d_cpu[rid])
                        cell["p_pack"].append(clock.p_pack.get(rid, 0.0))
                        cell["packed"].append(float(was_packed))
    finally:
        undo()
        for ex in (*ds.values(), p):
            ex.close()
    return out


def render(samples: dict[int, dict[str, dict[str, list[float]]]], load: str) -> str:
    first = next(iter(samples.values()))
    n = len(first[VARIANTS[0]]["wall"])
    lines = [f"kvgeom connector, P block {P_BLOCK} -> D block {D_BLOCK} (CPU_ATTN, tiny float32 Llama, TP1), "
             f"medians of {n} requests; load average {load}",
             f"{'':40}" + "".join(f"{v:>10}" for v in VARIANTS) + "".join(f"{v + '/direct':>15}" for v in VARIANTS[1:])]
    labels = {"wall": "pull wall time (ms)", "d_cpu": "D plan + offer + post CPU (ms)",
              "p_pack": "P packing CPU (ms)"}
    for m, cell in samples.items():
        share = statistics.mean(cell["auto"]["packed"])
        lines.append(f"  {m}-token prompt ({m * LAYERS * HEADS * DIM * 2 * 4 / 2**20:.1f} MiB); auto packed "
                     f"{share:.0%} of its pulls")
        for k, label in labels.items():
            med = [statistics.median(cell[v][k]) for v in VARIANTS]
            lines.append(f"    {label:36}" + "".join(f"{x * 1e3:10.3f}" for x in med)
                         + "".join(f"{(x / med[0] if med[0] > 0 else 0):15.2f}" for x in med[1:]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.common import load_average

    ap = argparse.ArgumentParser(prog="python -m benchmarks.connector_packed",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[517, 4096, 16384],
                    help="prompt lengths (default 517 4096 16384)")
    ap.add_argument("--requests", type=int, default=10, help="kept requests per cell (default 10)")
    args = ap.parse_args(argv)
    if any(t <= 0 for t in args.tokens):
        ap.error(f"--tokens {args.tokens}: every length must be positive")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: must be at least 1")
    print(render(measure(args.tokens, args.requests), load_average()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
