"""Receive steps (kvgeom_nixl.receive, torch on CPU tensors) against copying the touched bytes once.

    staged plan, P NHD -> D HND, D lists N = M + M/4 tokens (so [M, N) is zeroed)
    apply_rearranges(D views, plan.rearranges)   vs  torch clone of sum(nbytes_per_page * pages) B
    apply_zeros(D views, plan.zeros)             vs  torch clone of plan.bytes_zeroed B
    rearrange bandwidth = rearranged bytes / time   vs  planner CostModel default 1.5 GB/s

The D caches are filled before timing (warm pages). Re-applying a rearrange permutes the bytes
again, which costs the same; the values do not matter here.

Worked number: 4 layers, 8 heads of 256 B, K = 16, TP1, M = 16384: 1024 pages of
2 * 8 * 16 * 256 = 65536 B per layer are rearranged, 4 * 1024 * 65536 B = 256 MiB; at 1.5 GB/s
that is 0.18 s.
"""

from __future__ import annotations

from typing import Any

from kvgeom import CostModel, fresh_request

from .cases import build_case
from .common import Config, Measurement, Progress, interleaved_medians, measurement, quiet
from .transfer import set_nixl_env

__all__ = ["RECEIVE_CASE", "run_receive"]

RECEIVE_CASE = "syn-nhd-hnd-staged"


def run_receive(config: Config, progress: Progress = quiet) -> list[Measurement]:
    set_nixl_env()
    import torch

    from kvgeom_nixl.receive import apply_rearranges, apply_zeros

    M = config.receive_tokens
    N = M + M // 4
    case = build_case(RECEIVE_CASE, N, layers=config.receive_layers)
    request = fresh_request(case.pair, M, decode_tokens=N)
    plan = case.pair.plan(request, strategy="staged")
    d_plan = plan.for_decode_rank(0)
    if case.pair.decode.tp != 1:
        raise RuntimeError("the receive benchmark expects a TP1 decode engine")
    rearranged = sum(r.nbytes_per_page * len(r.pages) for r in d_plan.rearranges)
    zeroed = d_plan.bytes_zeroed
    progress(f"receive {RECEIVE_CASE} M={M} N={N}: {len(d_plan.rearranges)} rearranges "
             f"({rearranged / 2**20:.0f} MiB), {len(d_plan.zeros)} zero rows ({zeroed / 2**20:.0f} MiB)")
    views: list[Any] = [torch.full((r.nbytes,), 7, dtype=torch.uint8) for r in case.pair.decode.regions]
    src_r = torch.ones(rearranged, dtype=torch.uint8)
    src_z = torch.ones(max(zeroed, 1), dtype=torch.uint8)
    apply_rearranges(views, d_plan.rearranges)  # warm-up
    apply_zeros(views, d_plan.zeros)
    med = interleaved_medians({
        "rearranges": lambda: apply_rearranges(views, d_plan.rearranges),
        "clone_r": lambda: src_r.clone(),
        "zeros": lambda: apply_zeros(views, d_plan.zeros),
        "clone_z": lambda: src_z.clone(),
    }, config.receive_repeats)
    out = [
        measurement("receive", f"receive/rearranges/{M}", med["rearranges"], "s", med["clone_r"],
                    f"torch clone of the {rearranged} rearranged bytes",
                    note=f"{len(d_plan.rearranges)} rearranges over "
                         f"{sum(len(r.pages) for r in d_plan.rearranges)} pages"),
        measurement("receive", f"receive/zeros/{M}", med["zeros"], "s", med["clone_z"],
                    f"torch clone of the {zeroed} zeroed bytes",
                    note=f"{len(d_plan.zeros)} zero rows, D tokens [{M}, {N})"),
        measurement("receive", "receive/rearrange-bandwidth", rearranged / med["rearranges"] / 1e9, "GB/s",
                    CostModel().rearrange_bytes_per_second / 1e9,
                    "planner CostModel.rearrange_bytes_per_second default",
                    note=f"warm pages; clone moves {rearranged / med['clone_r'] / 1e9:.2f} GB/s"),
    ]
    return out
