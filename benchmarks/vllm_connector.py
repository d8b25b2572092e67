"""kvgeom's vLLM connector against vLLM's NixlConnector on the same geometry, side by side in one run.

    python -m benchmarks.vllm_connector [--tokens 4096] [--requests 5]
                                        [--connectors nixl,kvgeom-before,kvgeom,kvgeom-eager]

Per connector one P and one D vLLM instance (tests/vllm_pd.Instance: the tiny float32 Llama of
tests/vllm_models.py with room for the prompt, block 32, TP1, separate processes on 127.0.0.1),
all started at once and driven in turn, request by request (the order alternating), so that both connectors see the
same machine load. ``kvgeom-before`` is kvgeom's connector with this benchmark's fixes undone in its
processes (:func:`benchmarks.vllm_timing._before`), for a before/after in the same run;
``kvgeom-eager`` is kvgeom's connector with ``"eager_pull": true`` (the READ at once, no
``req``/grant round trip; docs/design.md §8.1). After two warm-up requests of each kind (the
handshake, the first plan and step; then kvgeom learns the shape's recipe, with two probe plans):

* ``prompt``: ``--requests`` fresh prompts of ``--tokens`` tokens; P prefills, D pulls every block.
* ``hit``: D first computes ``--tokens`` tokens itself (whole blocks, in its prefix cache), then
  the same tokens plus two through P; D pulls only the last block, holding 1 token (D computes the
  prompt's last token itself, as every P/D run does: with one token more there is nothing to pull).

Measured on D's worker by the hooks of :mod:`benchmarks.vllm_timing` (installed through
tests/vllm_e2e_site/sitecustomize.py with ``KVGEOM_BENCH_TIMINGS``), per request:

* overhead: the worker's per-request plan + post (kvgeom: ``_start_pull`` on its jobs thread:
  request from the block tables, plan, ``link.pull`` under the lock, plus the READ's own posting
  on the progress thread once P granted; vLLM: ``_read_blocks_for_req`` on the engine thread:
  block-id mapping, descriptor ids, ``make_prepped_xfer`` + ``transfer``), wall and thread CPU
  time. NIXL over UCX on one host copies much of a READ inside ``transfer()``, so for 8 MiB
  both connectors' overhead includes most of the copy;
* engine thread: the CPU time of the worker's ``start_load_kv`` call that started the pull, on
  vLLM's engine thread (what delays the forward pass most directly; kvgeom: the pull jobs queued,
  its plan and post run on the connector's own threads; vLLM: kernel block ids and the whole post);
* queue -> post: from the engine thread's hand-off to the posted READ (kvgeom's jobs-thread wait
  included; for vLLM the same as its overhead);
* transfer: posted -> first seen done by the worker;
* D TTFT: the wall time of D's request from the benchmark (``max_tokens=1``: the pull, then one
  step), through the instance's stdin/stdout.

Medians, and each kvgeom variant over nixl. Wall times on a shared machine: read the ratios and the CPU
column; the 1-minute load average is printed with the table. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks.common import load_average  # noqa: E402
from benchmarks.vllm_timing import BEFORE, ENV, RequestTiming, read_events, request_timings  # noqa: E402

__all__ = ["CONNECTORS", "DEFAULT_CONNECTORS", "KINDS", "METRICS", "parse_args", "render", "main"]

CONNECTORS = ("nixl", "kvgeom-before", "kvgeom", "kvgeom-eager")
DEFAULT_CONNECTORS = ("nixl", "kvgeom", "kvgeom-eager")
KINDS = ("prompt", "hit")
#: (key, label, unit scale): the rows of each kind, in order
METRICS = (("overhead", "D plan+post, wall (ms)", 1e3), ("overhead_cpu", "D plan+post, CPU (ms)", 1e3),
           ("engine_cpu", "D engine thread, CPU (ms)", 1e3), ("queue_to_post", "D queue -> posted (ms)", 1e3), ("transfer", "transfer post->done (ms)", 1e3),
           ("ttft", "D TTFT (ms)", 1e3))
BLOCK = 32
WARMUP = 2  # rounds not kept: kvgeom plans a shape's first request and learns its recipe on the second


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_connector",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens, a multiple of 32 (default 4096)")
    ap.add_argument("--requests", type=int, default=5, help="measured requests per kind and connector (default 5)")
    ap.add_argument("--connectors", default=",".join(DEFAULT_CONNECTORS),
                    help=f"comma-separated, from {', '.join(CONNECTORS)} (kvgeom-before: kvgeom's connector "
                    "without this benchmark's fixes, see benchmarks.vllm_timing); ratios need nixl")
    ap.add_argument("--kv-cache-mb", type=int, default=128, help="each instance's KV cache (MiB)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, event files)")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.tokens % BLOCK:
        ap.error(f"--tokens {args.tokens}: must be a positive multiple of the block size {BLOCK}")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: must be at least 1")
    names = [c for c in args.connectors.split(",") if c]
    bad = [c for c in names if c not in CONNECTORS]
    if bad or not names or len(set(names)) != len(names):
        ap.error(f"--connectors {args.connectors!r}: a list of distinct names from {', '.join(CONNECTORS)}")
    args.connectors = names
    return args


@dataclass
class Sample:
    """One measured D request: the worker's timing, the client's TTFT, sanity facts."""

    timing: RequestTiming
    ttft: float
    same_token: bool

    def value(self, key: str) -> float:
        return self.ttft if key == "ttft" else float(getattr(self.timing, key))


def render(samples: dict[str, dict[str, list[Sample]]], tokens: int, requests: int, load: str,
           bytes_per_token: int) -> str:
    """The table: per kind, one row per metric, a column per connector and one per kvgeom variant
    over nixl."""
    names = [c for c in CONNECTORS if c in samples]
    ratios = [c for c in names if c != "nixl"] if "nixl" in names else []
    head = f"{'':34}" + "".join(f"{c:>14}" for c in names) + "".join(f"{c + '/nixl':>20}" for c in ratios)
    lines = [f"vLLM P/D, tiny float32 Llama (2 layers, 4 KV heads x 32, block {BLOCK}, TP1), D pulls from P; "
             f"medians of {requests} requests after {WARMUP} warm-up rounds; load average {load}", head]
    titles = {"prompt": f"{tokens}-token prompt ({tokens * bytes_per_token / 2**20:.1f} MiB pulled)",
              "hit": f"prefix hit: D holds {tokens} tokens, pulls 1 more (in one {bytes_per_token * BLOCK // 1024} KiB block)"}
    for kind in KINDS:
        lines.append(titles[kind])
        for key, label, scale in METRICS:
            med = {c: statistics.median(s.value(key) for s in samples[c][kind]) for c in names}
            row = f"  {label:32}" + "".join(f"{med[c] * scale:14.3f}" for c in names)
            for c in ratios:
                row += f"{med[c] / med['nixl']:20.2f}" if med["nixl"] > 0 else f"{'-':>20}"
            lines.append(row)
        facts = ", ".join(f"{c} {'/'.join(str(b) for b in sorted({x.timing.blocks for x in samples[c][kind]}))} "
                          f"blocks, {sum(x.same_token for x in samples[c][kind])}/{len(samples[c][kind])}"
                          for c in names)
        lines.append(f"  (D blocks pulled, D's first token = P's: {facts})")
    return "\n".join(lines)


class Pair:
    """One connector's P and D instances, and D's event file."""

    def __init__(self, connector: str, model: Path, root: Path, args: argparse.Namespace) -> None:
        from vllm_pd import Instance

        self.connector = connector
        self.events = root / f"events-{connector}.jsonl"
        before = {BEFORE: "1"} if connector == "kvgeom-before" else {}
        common: dict[str, Any] = {"connector": connector.split("-")[0], "log_dir": root,
                                  "kv_cache_mb": args.kv_cache_mb, "max_model_len": args.tokens + 2 * BLOCK}
        if connector == "kvgeom-eager":  # READs at once, no req/grant (kv_connector_extra_config)
            common["extra"] = {"eager_pull": True}
        # (P's hooks too: the before variant's patches apply where the timing hooks are installed)
        self.p = Instance(f"bench-{connector}-p", model, env={ENV: str(root / f"events-{connector}-p.jsonl"), **before},
                          **common)
        self.d = Instance(f"bench-{connector}-d", model, env={ENV: str(self.events), **before}, **common)
        self.offset = 0

    def ready(self) -> None:
        self.p.wait_ready()
        self.d.wait_ready()

    def request(self, prompt: list[int], hit: bool) -> Sample:
        if hit:  # D computes all but the last 2 tokens itself (whole blocks: its prefix cache holds them)
            self.d.generate(prompt[:-2], 1)
        out_p = self.p.generate(prompt, 1, {"do_remote_decode": True})
        params = out_p.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"{self.p.name} returned no kv_transfer_params: {out_p}")
        _, self.offset = read_events(self.events, self.offset)  # (nothing of D's own prefill counts)
        t0 = time.perf_counter()
        out_d = self.d.generate(prompt, 1, params)
        ttft = time.perf_counter() - t0
        if out_d.get("finish_reason") not in ("length", "stop"):
            raise RuntimeError(f"{self.d.name}: finish_reason {out_d.get('finish_reason')!r}")
        events, self.offset = read_events(self.events, self.offset)
        return Sample(request_timings(events), ttft, out_d["tokens"][:1] == out_p["tokens"][:1])

    def close(self) -> None:
        for inst in (self.d, self.p):
            try:
                inst.close()
            except Exception as e:  # noqa: BLE001 - close the others anyway, then say which one stayed
                print(f"{inst.name}: close failed ({type(e).__name__}: {e}); pid {inst.proc.pid}", file=sys.stderr)


def _model(root: Path, tokens: int) -> Path:
    from vllm_models import write_model

    model = write_model(root / "llama", "llama")
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), tokens + 2 * BLOCK)
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    return model


def main(argv: Sequence[str] | None = None) -> None:
    from vllm_models import HEAD_DIM, KV_HEADS, LAYERS, prompts

    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvgeom-vllm-bench-"))
    model = _model(root, args.tokens)
    pairs = [Pair(c, model, root, args) for c in args.connectors]
    samples: dict[str, dict[str, list[Sample]]] = {c: {k: [] for k in KINDS} for c in args.connectors}
    try:
        started = time.perf_counter()
        for pair in pairs:
            pair.ready()
        print(f"instances ready in {time.perf_counter() - started:.0f} s (logs in {root})", file=sys.stderr)
        n = args.requests
        fresh = prompts([args.tokens] * (n + WARMUP), seed=11)
        hits = prompts([args.tokens + 2] * (n + WARMUP), seed=12)
        for i in range(n + WARMUP):  # i < WARMUP: the warm-up, not kept
            order = pairs if i % 2 == 0 else pairs[::-1]
            for kind, prompt in (("prompt", fresh[i]), ("hit", hits[i])):
                for pair in order:
                    s = pair.request(prompt, hit=kind == "hit")
                    if i >= WARMUP:
                        samples[pair.connector][kind].append(s)
            print(f"round {i + 1}/{n + WARMUP} done", file=sys.stderr)
        load = load_average()
    finally:
        for pair in pairs:
            pair.close()
    bytes_per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    print(render(samples, args.tokens, args.requests, load, bytes_per_token))
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
