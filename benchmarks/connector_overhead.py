"""D's per-request plan + post CPU in kvgeom's vLLM connector: planned, from a recipe, and eager, side by side (no vLLM).

    python -m benchmarks.connector_overhead [--tokens 4096] [--requests 20]

One P and three D :class:`~kvgeom_nixl.vllm.executor.ConnectorExecutor` in this process (the tiny
float32 Llama of ``python -m benchmarks.vllm_connector``: 2 layers, 4 KV heads x 32, block 32, TP1,
CPU_ATTN pages, NIXL over UCX on 127.0.0.1): ``planned`` plans every request (``recipes=False``:
the block tables, the request, the plan and its rows checked at every layer, as every request did
before), ``recipe`` posts a shape seen before from its recipe (:mod:`kvgeom_nixl.vllm.recipes`);
both ask P first (``req``) and READ once it grants (the connector's default). ``eager``
(``"eager_pull": true``) posts from the recipe and READs at once (``Link.pull``'s ``eager``: no
``req``, P's ``held`` after the READ decides). Requests alternate between the D executors, each with fresh block ids (P's and D's lists
start elsewhere every time), for the two cells of the vLLM benchmark:

* ``prompt``: ``--tokens`` tokens, every block pulled (vLLM's numbers: computed = the prompt, the
  last token recomputed on D);
* ``hit``: D holds ``--tokens`` tokens, pulls the one block with the 2 tokens past them.

A second table times the recipe key alone (``PullRecipes.shape``, in a tight loop) for a 1-block
pull after contexts of 4k to 128k tokens, side by side: keyed as a prefix hit (P's ids past the hit
only, what the connector does) and with P's whole list keyed (what a request with no hit costs, and
every hit cost before the key left the hit's blocks out).

Measured per request as the vLLM benchmark does (:mod:`benchmarks.vllm_timing`): the thread CPU
time of ``_start_pull`` (jobs thread) plus that of the READ's posting (``Transfer._post_to``: on
the progress thread once P granted, or at once for an eager pull). The first 2
requests of each shape (planned, then learnt) are not kept. Medians; nothing is asserted. For 8
MiB pulled, the posting includes UCX's copy.
"""

from __future__ import annotations

import argparse
import functools
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

__all__ = ["VARIANTS", "PARTS", "KINDS", "KEY_CONTEXTS", "main", "measure", "render", "key_costs", "render_keys"]

VARIANTS = ("planned", "recipe", "eager")
#: each variant's ConnectorExecutor options: planned and recipe READ after P's grant (req -> grant,
#: the connector's default), eager READs at once (a recipe; "eager_pull": true)
OPTIONS = {"planned": {"recipes": False, "eager": False}, "recipe": {"recipes": True, "eager": False},
           "eager": {"recipes": True, "eager": True}}
PARTS = tuple(f"{v}/read" for v in VARIANTS)
KINDS = ("prompt", "hit")
HEADS, DIM, LAYERS, BLOCK = 4, 32, 2, 32
WARMUP = 2  # requests of each (variant, kind) not kept: the first plans, the second learns
KEY_CONTEXTS = (4096, 32768, 131072)  # tokens D holds before the 1-block pull, for the key table


class _Clock:
    """Thread CPU time of D's per-request work, by transfer id (P's request id)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.read: dict[str, float] = {}  # the READ's posting alone (its part of cpu)
        self.lock = threading.Lock()

    def add(self, tid: str, cpu: float, read: bool = False) -> None:
        with self.lock:
            self.cpu[tid] = self.cpu.get(tid, 0.0) + cpu
            if read:
                self.read[tid] = self.read.get(tid, 0.0) + cpu

    def _post(self, cpu: float, t: Any, *_: Any) -> None:
        if t.kind == "pull":  # (D's READ; P's transfers post nothing timed here)
            self.add(t.request_id, cpu, read=True)

    def install(self) -> Callable[[], None]:
        """Wrap ``PullSide._start_pull`` and ``Transfer._post_to``; returns the undo."""
        from benchmarks.common import thread_cpu_hook
        from kvgeom_nixl.transfer import Transfer
        from kvgeom_nixl.vllm.pulls import PullSide

        undos = [thread_cpu_hook(PullSide, "_start_pull", lambda cpu, ex, job: self.add(job.transfer_id, cpu)),
                 thread_cpu_hook(Transfer, "_post_to", self._post)]

        def undo() -> None:
            for u in undos:
                u()
        return undo


def _caches(blocks: int, fill: float) -> dict[str, Any]:
    import torch

    per = blocks * HEADS * BLOCK * 2 * DIM
    buf = torch.full((LAYERS * per,), fill)
    return {f"model.layers.{i}.self_attn.attn": buf[i * per:(i + 1) * per].view(blocks, HEADS, BLOCK, 2 * DIM)
            for i in range(LAYERS)}


def measure(tokens: int, requests: int, *, timeout_s: float = 60.0) -> dict[str, dict[str, list[float]]]:
    """Per variant and kind, the kept requests' plan + post CPU (seconds); ``<variant>/read``: the
    READ's posting alone (its part of that)."""
    from kvgeom_nixl.testing import free_ports
    from kvgeom_nixl.vllm.caches import CacheGroup, geometry_from_kv_caches
    from kvgeom_nixl.vllm.executor import ConnectorExecutor, PullJob, ReleaseJob

    nb = tokens // BLOCK + 2
    pool = 4 * nb + 8  # room for each request's lists to start elsewhere
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    group = CacheGroup("g0", "full", names, BLOCK, HEADS, None, {n: "CPU_ATTN" for n in names},
                       {n: "vec" for n in names})
    port = free_ports(1)
    p_geo, p_layers = geometry_from_kv_caches(_caches(pool, 1.0), [group], tp=1, name="P")
    p = ConnectorExecutor(p_geo, 0, 1, p_layers, engine_id="P", producer=True, consumer=False, port=port)
    ds = {}
    for v in VARIANTS:
        geo, layers = geometry_from_kv_caches(_caches(pool, -7.0), [group], tp=1, name=f"D-{v}")
        ds[v] = ConnectorExecutor(geo, 0, 1, layers, engine_id=f"D-{v}", producer=False, consumer=True,
                                  recipes=OPTIONS[v]["recipes"], eager=OPTIONS[v]["eager"])
    clock = _Clock()
    undo = clock.install()
    out: dict[str, dict[str, list[float]]] = {v: {k: [] for k in KINDS} for v in (*VARIANTS, *PARTS)}
    rng = random.Random(5)
    try:
        for i in range(requests + WARMUP):
            for kind in KINDS:
                for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):  # (the order alternates)
                    d = ds[v]
                    rid = f"{v}-{kind}-{i}"
                    m, hit = (tokens, 0) if kind == "prompt" else (tokens + 2, tokens)
                    n_p = -(-m // BLOCK)
                    n_d = n_p - hit // BLOCK
                    p0, d0 = rng.randrange(1, pool - n_p), rng.randrange(1, pool - n_d)
                    p.send(rid, 60.0)
                    d.pull(PullJob(f"d-{rid}", rid, "P", m, hit, (tuple(range(p0, p0 + n_p)),),
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
                        time.sleep(0.001)
                    time.sleep(0.005)  # (the progress thread's last tick of this request)
                    if i >= WARMUP:
                        out[v][kind].append(clock.cpu[rid])
                        out[f"{v}/read"][kind].append(clock.read[rid])
        for v in VARIANTS:
            if not OPTIONS[v]["recipes"]:
                continue
            applied = ds[v]._d_recipes["P"].counts["applied"] if "P" in ds[v]._d_recipes else 0
            if applied != len(KINDS) * requests:
                raise RuntimeError(f"the {v} variant applied {applied} recipes, expected {len(KINDS) * requests}")
    finally:
        undo()
        for ex in (*ds.values(), p):
            ex.close()
    return out


def render(samples: dict[str, dict[str, list[float]]], tokens: int, load: str) -> str:
    """The table: per cell, each variant's plan + post, then its two parts (the jobs thread: plan
    or recipe, checks, the transfer and its ``req``; the progress thread: the READ's posting)."""
    first = VARIANTS[0]
    ratios = [f"{v}/{first}" for v in VARIANTS[1:]]
    lines = [f"D plan+post CPU per request (ms), kvgeom connector, tiny float32 Llama (block {BLOCK}, TP1), "
             f"medians of {len(samples[first][KINDS[0]])} requests; load average {load}",
             f"{'':44}" + "".join(f"{v:>10}" for v in VARIANTS) + "".join(f"{r:>16}" for r in ratios)]
    titles = {"prompt": f"{tokens}-token prompt (every block)", "hit": f"prefix hit (D holds {tokens}, pulls 1 block)"}
    for kind in KINDS:
        med = {v: statistics.median(samples[v][kind]) for v in (*VARIANTS, *PARTS)}
        rows = [(titles[kind], [med[v] for v in VARIANTS]),
                ("  of which: plan/recipe + post, req", [med[v] - med[f"{v}/read"] for v in VARIANTS]),
                ("  of which: the READ's posting", [med[f"{v}/read"] for v in VARIANTS])]
        for label, values in rows:
            lines.append(f"  {label:42}" + "".join(f"{x * 1e3:10.3f}" for x in values)
                         + "".join(f"{(x / values[0] if values[0] > 0 else 0):16.2f}" for x in values[1:]))
    return "\n".join(lines)


def key_costs(contexts: Sequence[int] = KEY_CONTEXTS, *, number: int = 2000) -> dict[int, tuple[float, float]]:
    """Per context (tokens D holds), the best-of-5 time (seconds) of one ``PullRecipes.shape`` for
    a 1-block pull after it: (keyed as the hit, P's whole list keyed). The second is the same
    lists with the hit's token count left out of the key's P part (``prefix_hit_tokens`` below one
    P block), so both key the same two lists and differ only in what of P's list is read."""
    import timeit

    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair
    from kvgeom_nixl.vllm.recipes import PullRecipes

    model = ModelSpec("tiny", [AttentionSpec("attn", "full", LAYERS, HEADS, DIM)])
    out = {}
    for held in contexts:
        n = held // BLOCK + 1
        engine = EngineGeometry.build(model, tp=1, kernel_block_tokens=BLOCK, num_blocks=n + 16, layout="CPU_ATTN")

        class _Link:  # (what PullRecipes reads of a link before planning: its pair)
            pair = Pair(engine, engine)

        book = PullRecipes(_Link(), "auto", 0)  # type: ignore[arg-type]
        remote, local = [tuple(range(7, 7 + n))], [(5,)]
        m = held + BLOCK
        past, whole = (functools.partial(book.shape, m, hit, m, remote, local) for hit in (held, BLOCK - 1))
        out[held] = (min(timeit.repeat(past, number=number, repeat=5)) / number,
                     min(timeit.repeat(whole, number=number, repeat=5)) / number)
    return out


def render_keys(costs: dict[int, tuple[float, float]]) -> str:
    lines = ["recipe key (PullRecipes.shape) of a 1-block pull, tight loop (us): P's ids past the hit vs P's whole list",
             f"{'':36}{'past the hit':>14}{'whole list':>14}{'whole/past':>12}"]
    for held, (past, whole) in costs.items():
        lines.append(f"  {f'after {held} tokens ({held // BLOCK + 1} P ids)':34}{past * 1e6:14.1f}{whole * 1e6:14.1f}"
                     f"{whole / past if past > 0 else 0:12.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.common import load_average

    ap = argparse.ArgumentParser(prog="python -m benchmarks.connector_overhead",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens, a multiple of 32 (default 4096)")
    ap.add_argument("--requests", type=int, default=20, help="kept requests per variant and kind (default 20)")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.tokens % BLOCK:
        ap.error(f"--tokens {args.tokens}: must be a positive multiple of the block size {BLOCK}")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: must be at least 1")
    samples = measure(args.tokens, args.requests)
    print(render(samples, args.tokens, load_average()))
    print()
    print(render_keys(key_costs()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
