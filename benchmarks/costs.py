"""The planner's CostModel numbers, measured on one device: ``python -m benchmarks.costs [--device cpu|cuda]``.

    descriptor_seconds          n READ descriptors of 64 B (4 KiB apart) vs one of n * 64 B, two
                                in-process NIXL agents, memory on the device (DRAM or VRAM)
    wire_bytes_per_second       one descriptor of ``--mib`` MiB between the agents
    copy_bytes_per_second       a pack and an unpack of one NHD -> HND page layout (256 B head
                                vectors, the executor's own kvgeom_nixl.staging.run_steps)
    rearrange_bytes_per_second  the executor's apply_rearranges of the same layout change in place
    op_seconds                  one pack step of a single 4 KiB page (what launching an op costs)

It prints the numbers and the ``CostModel(...)`` to pass to the planner (``--json``: one object).
``scripts/gpu-check`` runs it with ``--device cuda``; the CUDA defaults of ``CostModel.cuda()``
are estimates until such a run replaces them (docs/design.md §12.6).

Worked number: 4096 descriptors in 7.0 ms against one in 0.9 ms gives (7.0 - 0.9) / 4096 = 1.5 us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

__all__ = ["measure_costs", "main"]


def _median(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _descriptors(device: str, n: int, mib: int, repeats: int) -> tuple[float, float]:
    """(seconds per descriptor, wire bytes per second) between two agents on ``device``."""
    import numpy as np
    import torch

    from kvgeom_nixl.agent import nixl_api, set_nixl_log_level

    api = nixl_api()  # the meta package's, or one CUDA flavour's
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    set_nixl_log_level()

    mem = "VRAM" if device.startswith("cuda") else "DRAM"
    dev = 0 if mem == "DRAM" else torch.device(device).index or 0
    tag = uuid.uuid4().hex[:8]
    a = nixl_agent(f"costs-d-{tag}", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    b = nixl_agent(f"costs-p-{tag}", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    size = max(n * 4096, mib << 20)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.zeros(size, dtype=torch.uint8, device=device)
    ra = a.register_memory([(dst.data_ptr(), size, dev, "")], mem)
    rb = b.register_memory([(src.data_ptr(), size, dev, "")], mem)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())

    def descs(base: int, count: int, stride: int, length: int) -> np.ndarray:
        out = np.empty((count, 3), np.uint64)
        out[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(stride)
        out[:, 1] = length
        out[:, 2] = dev
        return out

    def post(local: np.ndarray, remote: np.ndarray) -> None:
        h = a.initialize_xfer("READ", a.get_xfer_descs(local, mem), a.get_xfer_descs(remote, mem), f"costs-p-{tag}",
                              b"costs")
        state = a.transfer(h)
        while state == "PROC":
            b.get_new_notifs()
            state = a.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in {state}")
        h.release()

    none = lambda: None  # noqa: E731 - NIXL completion is the synchronisation here
    try:
        many = (descs(dst.data_ptr(), n, 4096, 64), descs(src.data_ptr(), n, 4096, 64))
        one = (descs(dst.data_ptr(), 1, 0, n * 64), descs(src.data_ptr(), 1, 0, n * 64))
        big = (descs(dst.data_ptr(), 1, 0, mib << 20), descs(src.data_ptr(), 1, 0, mib << 20))
        t_many = _median(lambda: post(*many), repeats, none)
        t_one = _median(lambda: post(*one), repeats, none)
        t_big = _median(lambda: post(*big), repeats, none)
    finally:
        a.remove_remote_agent(f"costs-p-{tag}")
        b.remove_remote_agent(f"costs-d-{tag}")
        a.deregister_memory(ra)
        b.deregister_memory(rb)
    return max(t_many - t_one, 1e-9) / n, (mib << 20) / t_big


def _copies(device: str, tokens: int, repeats: int) -> tuple[float, float, float]:
    """(pack/unpack bytes per second, rearrange bytes per second, seconds per op) on ``device``."""
    import torch

    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request
    from kvgeom_nixl.memory import RankMemory
    from kvgeom_nixl.receive import apply_rearranges
    from kvgeom_nixl.staging import StagingBuffer, run_steps

    model = ModelSpec("costs", [AttentionSpec("attn", "full", 1, 8, 256)])
    blocks = tokens // 16 + 1
    pair = Pair(EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=blocks, layout="NHD", name="p"),
                EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=blocks, name="d"))
    request = fresh_request(pair, tokens)
    plan = pair.plan(request, strategy="packed")
    staged = pair.plan(request, strategy="staged")
    nbytes = plan.bytes_copied
    p_caches = [torch.ones(r.nbytes, dtype=torch.uint8, device=device) for r in pair.prefill.regions]
    d_caches = [torch.zeros(r.nbytes, dtype=torch.uint8, device=device) for r in pair.decode.regions]
    p_mem, d_mem = RankMemory(pair.prefill, p_caches), RankMemory(pair.decode, d_caches)
    slot = int(plan.staging_used("prefill").max())
    ring_p, ring_d = StagingBuffer(p_mem, slot), StagingBuffer(d_mem, slot)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def pack_unpack() -> None:
        run_steps(plan.packs, p_mem.byte_views(), ring_p, 0, pack=True)
        ring_d.view(0).copy_(ring_p.view(0))
        run_steps(plan.unpacks, d_mem.byte_views(), ring_d, 0, pack=False)

    def ring_copy() -> None:
        ring_d.view(0).copy_(ring_p.view(0))

    t_pu = _median(pack_unpack, repeats, sync) - _median(ring_copy, repeats, sync)
    t_re = _median(lambda: apply_rearranges(d_mem.byte_views(), staged.rearranges), repeats, sync)
    one_page = pair.plan(fresh_request(pair, 16), strategy="packed")
    t_op = _median(lambda: run_steps(one_page.packs, p_mem.byte_views(), ring_p, 1, pack=True), repeats * 10, sync)
    rearranged = sum(r.nbytes_per_page * len(r.pages) for r in staged.rearranges)
    return 2 * nbytes / max(t_pu, 1e-9), rearranged / t_re, t_op


def measure_costs(device: str = "cpu", *, descriptors: int = 4096, mib: int = 64, tokens: int = 16384,
                  repeats: int = 5) -> dict[str, float]:
    """Every CostModel number on ``device`` (see the module docstring)."""
    import torch

    threads = torch.get_num_threads()
    per_desc, wire = _descriptors(device, descriptors, mib, repeats)
    copy, rearrange, op = _copies(device, tokens, repeats)
    return {"device": device, "torch_threads": threads, "descriptor_seconds": per_desc,  # type: ignore[dict-item]
            "wire_bytes_per_second": wire, "copy_bytes_per_second": copy, "rearrange_bytes_per_second": rearrange,
            "op_seconds": op}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.costs", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the pack/unpack layout (default 16384)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    out = measure_costs(args.device, tokens=args.tokens)
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"device {out['device']}, torch threads {out['torch_threads']}")
    print(f"  descriptor_seconds          {out['descriptor_seconds'] * 1e6:8.2f} us")
    print(f"  wire_bytes_per_second       {out['wire_bytes_per_second'] / 1e9:8.2f} GB/s")
    print(f"  copy_bytes_per_second       {out['copy_bytes_per_second'] / 1e9:8.2f} GB/s (pack + unpack)")
    print(f"  rearrange_bytes_per_second  {out['rearrange_bytes_per_second'] / 1e9:8.2f} GB/s")
    print(f"  op_seconds                  {out['op_seconds'] * 1e6:8.2f} us")
    print(f"CostModel(descriptor_seconds={out['descriptor_seconds']:.3g}, "
          f"rearrange_bytes_per_second={out['rearrange_bytes_per_second']:.3g}, "
          f"copy_bytes_per_second={out['copy_bytes_per_second']:.3g}, op_seconds={out['op_seconds']:.3g}, "
          f"wire_bytes_per_second={out['wire_bytes_per_second']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
