"""kvgeom's vLLM connector against vLLM's NixlConnector on the same geometry, side by side in one run.

    python -m benchmarks.vllm_connector [--tokens 1000] [--requests 5]

Per connector: one P and one D vLLM instance (tiny float32 Llama, block 32, TP1, separate processes
on 127.0.0.1, the harness of tests/vllm_e2e_cells.py), a warm-up request (handshake, compile), then
``--requests`` prompts of ``--tokens`` tokens and as many 1-token-prefill requests whose first
``--tokens`` tokens D already holds (a D prefix-cache hit: the pull is one block). Printed per
connector: the median wall time of D's request (time to first token: the pull, then one decode
step), of P's prefill, and their ratio to the other connector. A monolithic run's median time to
first token is the floor. Wall times on a shared machine: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from vllm_models import prompts, write_model  # noqa: E402
from vllm_pd import Instance  # noqa: E402


def _timed(inst: Any, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = inst.generate(prompt, max_tokens, params)
    return time.perf_counter() - t0, out


def run_connector(connector: str, model: Path, logs: Path, tokens: int, n: int, seed: int) -> dict[str, float]:
    p = Instance(f"bench-{connector}-p", model, connector=connector, log_dir=logs)
    d = Instance(f"bench-{connector}-d", model, connector=connector, log_dir=logs)
    try:
        p.wait_ready()
        d.wait_ready()
        warm = prompts([tokens], seed=seed + 99)[0]
        d.generate(warm, 1, p.generate(warm, 1, {"do_remote_decode": True})["kv_transfer_params"])
        fresh, d_ttft, p_prefill = prompts([tokens] * n, seed=seed), [], []
        for prompt in fresh:
            tp, out = _timed(p, prompt, 1, {"do_remote_decode": True})
            td, _ = _timed(d, prompt, 1, out["kv_transfer_params"])
            p_prefill.append(tp)
            d_ttft.append(td)
        hit_ttft = []
        for prompt in prompts([tokens] * n, seed=seed + 1):
            d.generate(prompt, 1)  # D holds the first `tokens` tokens (whole blocks of them)
            longer = prompt + [7]
            _, out = _timed(p, longer, 1, {"do_remote_decode": True})
            td, _ = _timed(d, longer, 1, out["kv_transfer_params"])
            hit_ttft.append(td)
        return {"d_ttft": statistics.median(d_ttft), "p_prefill": statistics.median(p_prefill),
                "d_hit_ttft": statistics.median(hit_ttft)}
    finally:
        p.close()
        d.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=5)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvgeom-vllm-bench-"))
    model = write_model(root / "llama", "llama")
    logs = root / "logs"
    logs.mkdir()
    mono = Instance("bench-mono", model, log_dir=logs)
    try:
        mono.wait_ready()
        mono.generate(prompts([args.tokens], seed=5)[0], 1)
        mono_ttft = statistics.median(_timed(mono, pr, 1)[0] for pr in prompts([args.tokens] * args.requests, seed=6))
    finally:
        mono.close()
    rows = {c: run_connector(c, model, logs, args.tokens, args.requests, seed=10) for c in ("nixl", "kvgeom")}
    print(f"{args.tokens}-token prompts, {args.requests} requests each, medians (s); monolithic TTFT {mono_ttft:.3f}")
    print(f"{'':22}{'nixl':>10}{'kvgeom':>10}{'kvgeom/nixl':>13}")
    for key, label in (("d_ttft", "D TTFT (pull+1 step)"), ("d_hit_ttft", "D TTFT, prefix hit"),
                       ("p_prefill", "P prefill")):
        a, b = rows["nixl"][key], rows["kvgeom"][key]
        print(f"{label:22}{a:10.3f}{b:10.3f}{b / a:13.2f}")


if __name__ == "__main__":
    main()
