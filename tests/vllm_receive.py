"""Run under the vLLM venv: kvgeom's receive-step records against vLLM's own receive code.

vLLM's NIXL connector regroups a D block that received ``ratio`` smaller P blocks with
``kv_postprocess_blksize_on_receive`` (D LBHNC) or ``kv_postprocess_blksize_and_layout_on_receive``
(D LBNHC), and zeroes a block's tail with ``cache[block, :, t:].zero_()``
(``vllm/distributed/kv_transfer/kv_connector/utils.py``, ``post_process_device_kv_on_receive``).
This script runs those functions on random bytes and applies kvgeom's
:func:`~kvgeom.conformance.regroup_rearrange` / :func:`~kvgeom.conformance.page_tail_zeros` to a
copy with the Rearrange's documented formula (docs/design.md §4.1; written out here with numpy, not
kvgeom's applier), then prints whether the bytes agree, plus a control (the other page order).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import (
    kv_postprocess_blksize_and_layout_on_receive,
    kv_postprocess_blksize_on_receive,
)

from kvgeom.conformance import page_tail_zeros, regroup_rearrange
from kvgeom.values.plan import Rearrange

B, H, N, C, RATIO = 5, 3, 16, 8, 4  # C: a cell of 8 bytes (e.g. K | V of 2 x 2 fp16)
BLOCKS = [1, 3]


def apply(buf: np.ndarray, r: Rearrange) -> np.ndarray:
    """The Rearrange formula: every element at page*page_bytes + src_offset + sum(i*src_strides) moves to
    the same with dst; all sources read before any write."""
    out = buf.copy()
    grid = np.indices(r.shape).reshape(len(r.shape), -1).T
    src = r.src_offset + grid @ np.array(r.src_strides)
    dst = r.dst_offset + grid @ np.array(r.dst_strides)
    for page in r.pages:
        base = page * r.page_bytes
        vals = [buf[base + s: base + s + r.unit_bytes].copy() for s in src]
        for d, v in zip(dst, vals):
            out[base + d: base + d + r.unit_bytes] = v
    return out


def cache(order: str) -> torch.Tensor:
    """A [B, H, N, C] int8 cache whose memory is LBHNC (head-major) or LBNHC (token-major)."""
    gen = torch.Generator().manual_seed(7)
    if order == "LBHNC":
        return torch.randint(-128, 127, (B, H, N, C), dtype=torch.int8, generator=gen)
    return torch.randint(-128, 127, (B, N, H, C), dtype=torch.int8, generator=gen).transpose(1, 2)


def memory(t: torch.Tensor, order: str) -> np.ndarray:
    """The tensor's bytes in memory order."""
    phys = t if order == "LBHNC" else t.transpose(1, 2)
    return phys.contiguous().numpy().reshape(-1).view(np.uint8).copy()


def regroup_agrees(order: str, model_order: str) -> bool:
    t = cache(order)
    before = memory(t, order)
    fn = kv_postprocess_blksize_on_receive if order == "LBHNC" else kv_postprocess_blksize_and_layout_on_receive
    fn(t, torch.tensor(BLOCKS), RATIO)
    r = regroup_rearrange(0, 0, BLOCKS, heads=H, tokens=N, cell_bytes=C, ratio=RATIO, page_bytes=H * N * C,
                          local_order=model_order)
    return bool(np.array_equal(apply(before, r), memory(t, order)))


def zeros_agree(order: str, from_token: int = 11) -> bool:
    t = cache(order)
    want = memory(t, order)
    for z in page_tail_zeros(0, 3 * H * N * C, heads=H, tokens=N, cell_bytes=C, from_token=from_token,
                             local_order=order):
        want[z[1]: z[1] + z[2]] = 0
    t[3, :, 11:].zero_()
    return bool(np.array_equal(want, memory(t, order)))


if __name__ == "__main__":
    print(json.dumps({
        "regroup_lbhnc": regroup_agrees("LBHNC", "LBHNC"),
        "regroup_lbnhc": regroup_agrees("LBNHC", "LBNHC"),
        "control_regroup_lbhnc_as_lbnhc": regroup_agrees("LBHNC", "LBNHC"),
        "control_regroup_lbnhc_as_lbhnc": regroup_agrees("LBNHC", "LBHNC"),
        "zeros_lbhnc": zeros_agree("LBHNC"),
        "zeros_lbnhc": zeros_agree("LBNHC"),
        "control_zeros_from_12": zeros_agree("LBHNC", 12),
    }))
