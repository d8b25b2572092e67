"""NIXL transfer time on this machine against one ``numpy.copyto`` of the same bytes, and the cost
of one NIXL descriptor.

    LocalDeployment(pair, P caches, D caches)     agents, registration, handshake: NOT timed
      .run(id, request, plan, mode="coalesced")   timed: per-request lowering (descriptor lists),
      .run(id, request, plan, mode="prepped")     post, transfer to completion on every rank,
                                                  notifications, receive steps
    RawNixl(ld, plan)()                           timed: the same coalesced lists posted with bare
                                                  initialize_xfer calls (descriptor arrays prebuilt)
    numpy.copyto(dst, src) of plan.bytes_copied   the physical limit (one memcpy, warm pages)
    ratio = run time / copyto time                goal: coalesced <= 1.5 on fresh blocks, M >= 16k

Caches come in two kinds: ``4k`` (``torch.empty``, as ``kvgeom_nixl.local.allocate_caches`` makes
them; 4 KiB pages) and ``thp`` (tensors over numpy arrays, which numpy asks the kernel to back with
transparent huge pages). UCX's CMA transport (``process_vm_readv``) pins every page it reads, so
the page size shows in the transfer time while ``memcpy`` barely notices it.

Each mode runs once untimed first (UCX wire-up, the prepped mode's per-rank tile tables), then
the modes and the copy alternate ``transfer_repeats`` times. In-process with the progress thread
off, NIXL's UCX backend (CMA on this machine) finishes a READ inside the post call, so the time
is posting + copying + the executor's bookkeeping.

Per-descriptor cost: two bare agents, ``n`` READ descriptors of 64 B at a 4 KiB stride (nothing
merges) against one descriptor of the same ``n * 64`` bytes; ``(t_n - t_1) / n``. Measured both
for the whole post path (``get_xfer_descs`` + ``initialize_xfer`` + transfer, what mode
"coalesced" pays per copy row) and for a repost of a ready handle (transfer only).

Worked number: 16384 descriptors taking 26.0 ms against 1.4 ms for one gives
(26.0 - 1.4) / 16384 = 1.5 us per descriptor, the planner's CostModel default.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom import CostModel

from .cases import build_case, pattern_request
from .common import Config, Measurement, Progress, interleaved_medians, measurement, quiet

__all__ = ["nixl_missing", "run_transfer", "descriptor_cost"]

TRANSFER_CASES = ("syn-tp1-tp1", "syn-tp2-tp1")
TRANSFER_PATTERNS = ("fresh", "scattered")
PAGE_KINDS = ("4k", "thp")  # torch.empty caches; numpy-backed caches (transparent huge pages)
TRANSFER_GOAL = "coalesced <= 1.5x numpy.copyto on fresh blocks at M >= 16k"
TRANSFER_LIMIT = 1.5


def set_nixl_env() -> None:
    """Quiet NIXL's stdout logging and keep UCX on loopback (before nixl is imported)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def read_and_wait(posts: Sequence[tuple[Any, Any, Any, str]], targets: Sequence[Any], tag: bytes) -> None:
    """Post one raw NIXL READ per ``(agent, local descs, remote descs, peer)`` and poll every
    initiator and every target (no progress thread) until all are DONE: the bound rows of the
    transfer and packed sections time this, with no kvgeom code in the loop."""
    pending = []
    for agent, local, remote, peer in posts:
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                  agent.get_xfer_descs(remote, "DRAM"), peer, tag)
        pending.append((agent, h, agent.transfer(h)))
    while pending:
        still = []
        for agent, h, state in pending:
            if state == "PROC":
                state = agent.check_xfer_state(h)
            if state == "PROC":
                still.append((agent, h, state))
            elif state == "DONE":
                h.release()
            else:
                raise RuntimeError(f"NIXL transfer ended in state {state}")
        for t in targets:
            t.get_new_notifs()
        pending = still


def nixl_missing(modules: tuple[str, ...] = ("torch", "kvgeom_nixl.local")) -> str | None:
    """Why a section needing ``modules`` and NIXL's Python API (the ``nixl`` meta package or one
    CUDA flavour alone, :func:`kvgeom_nixl.agent.nixl_api`) cannot run here, or ``None``."""
    set_nixl_env()
    for mod in modules:
        try:
            __import__(mod)
        except ImportError as e:
            return f"cannot import {mod}: {e}"
    from kvgeom_nixl.agent import nixl_api

    try:
        nixl_api()
    except ImportError as e:
        return f"cannot import NIXL's Python API: {e}"
    return None


def _wait(initiator: Any, target: Any, handle: Any) -> None:
    state = initiator.transfer(handle)
    while state == "PROC":
        target.get_new_notifs()
        state = initiator.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended in state {state}")
    target.get_new_notifs()


def _descs(base: int, count: int, stride: int, length: int) -> np.ndarray:
    a = np.empty((count, 3), np.uint64)
    a[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(stride)
    a[:, 1] = length
    a[:, 2] = 0
    return a


def descriptor_cost(n: int, repeats: int, progress: Progress = quiet) -> list[Measurement]:
    """Seconds per extra NIXL descriptor, post path and repost (see the module docstring)."""
    set_nixl_env()
    from kvgeom_nixl.agent import make_agent

    progress(f"nixl per-descriptor cost, {n} x 64 B")
    tag = uuid.uuid4().hex[:8]
    a = make_agent(f"bench-d-{tag}")
    b = make_agent(f"bench-p-{tag}")
    stride, unit = 4096, 64
    src = np.ones(n * stride, np.uint8)
    dst = np.zeros(n * stride, np.uint8)
    reg_a = a.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    reg_b = b.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    peer = f"bench-p-{tag}"
    many = (_descs(dst.ctypes.data, n, stride, unit), _descs(src.ctypes.data, n, stride, unit))
    one = (_descs(dst.ctypes.data, 1, 0, n * unit), _descs(src.ctypes.data, 1, 0, n * unit))

    def post(pair: tuple[np.ndarray, np.ndarray]) -> None:
        h = a.initialize_xfer("READ", a.get_xfer_descs(pair[0], "DRAM"), a.get_xfer_descs(pair[1], "DRAM"), peer,
                              b"bench")
        _wait(a, b, h)
        h.release()

    handles = {}
    try:
        post(many)  # wire-up
        med = interleaved_medians({"many": lambda: post(many), "one": lambda: post(one)}, repeats)
        for key, pair in (("many", many), ("one", one)):
            handles[key] = a.initialize_xfer("READ", a.get_xfer_descs(pair[0], "DRAM"),
                                             a.get_xfer_descs(pair[1], "DRAM"), peer, b"bench")
            _wait(a, b, handles[key])
        rep = interleaved_medians({k: functools.partial(_wait, a, b, h) for k, h in handles.items()}, repeats)
    finally:
        for h in handles.values():
            h.release()
        a.remove_remote_agent(peer)
        b.remove_remote_agent(f"bench-d-{tag}")
        a.deregister_memory(reg_a)
        b.deregister_memory(reg_b)
    default = CostModel().descriptor_seconds * 1e6
    per_post = max((med["many"] - med["one"]) / n * 1e6, 1e-6)
    per_repost = max((rep["many"] - rep["one"]) / n * 1e6, 1e-6)
    note = f"{n} x 64 B descriptors {med['many'] * 1e3:.2f} ms vs 1 x {n * unit} B {med['one'] * 1e3:.2f} ms"
    return [
        measurement("transfer", "nixl/per-descriptor/post", per_post, "us", default,
                    "planner CostModel.descriptor_seconds default", note=note + " (descs + initialize_xfer + transfer)"),
        measurement("transfer", "nixl/per-descriptor/repost", per_repost, "us", default,
                    "planner CostModel.descriptor_seconds default",
                    note=f"repost of a ready handle: {rep['many'] * 1e3:.2f} ms vs {rep['one'] * 1e3:.2f} ms"),
    ]


def _allocate(engine: Any, pages: str) -> list[list[Any]]:
    """Caches of ``engine``: ``torch.empty`` (4 KiB pages, what ``allocate_caches`` gives) or
    numpy-backed tensors (numpy asks the kernel for transparent huge pages on large arrays)."""
    import torch

    from kvgeom_nixl.local import allocate_caches

    if pages == "4k":
        return allocate_caches(engine)
    return [[torch.from_numpy(np.empty(r.nbytes if i in engine.rank_regions(rank) else 0, np.uint8))
             for i, r in enumerate(engine.regions)] for rank in range(engine.num_ranks)]


def _fill(caches: list[list[Any]], value: int) -> None:
    for regs in caches:
        for t in regs:
            t.fill_(value)


class RawNixl:
    """The plan's coalesced copies posted with bare NIXL calls on the deployment's agents: one
    ``initialize_xfer`` per (D rank, P rank), descriptor arrays built beforehand; what NIXL alone
    costs for the same lists, without the executor's bookkeeping."""

    def __init__(self, ld: Any, plan: Any) -> None:
        from kvgeom_nixl.lowering import copy_descs

        self.posts: list[tuple[Any, Any, np.ndarray, np.ndarray, str]] = []
        self.targets = [p.agent for p in ld.p]
        for d in ld.d:
            mine = plan.copies.take(plan.copies.d_rank == d.rank)
            for p in ld.p:
                c = mine.take(mine.p_rank == p.rank)
                if not len(c):
                    continue
                local = copy_descs(d.memory.bases, d.memory.devices, c.d_region, c.d_offset, c.nbytes)
                remote = copy_descs(p.memory.bases, p.memory.devices, c.p_region, c.p_offset, c.nbytes)
                self.posts.append((d.agent, p.agent, local, remote, p.name))

    def __call__(self) -> None:
        read_and_wait([(agent, local, remote, peer) for agent, _, local, remote, peer in self.posts],
                      self.targets, b"bench-raw")


MODES = ("coalesced", "prepped", "raw-nixl")


def _one_case(config: Config, name: str, pattern: str, pages: str, M: int, progress: Progress,
              counter: Any) -> list[Measurement]:
    from kvgeom_nixl.local import LocalDeployment

    case = build_case(name, M, pool_factor=1.0 if pattern == "fresh" else 2.0, layers=config.transfer_layers)
    request = pattern_request(case, pattern, np.random.default_rng(config.seed))
    plan = case.pair.plan(request, strategy=case.strategy)
    nbytes = plan.bytes_copied
    progress(f"transfer {name} {pattern} {pages} pages M={M}: {len(plan.copies)} copies, {nbytes / 2**20:.0f} MiB")
    p_caches = _allocate(case.pair.prefill, pages)
    d_caches = _allocate(case.pair.decode, pages)
    _fill(p_caches, 1)
    _fill(d_caches, 0)
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    notes: dict[str, str] = {}
    t0 = time.perf_counter()
    with LocalDeployment(case.pair, p_caches, d_caches) as ld:
        setup = time.perf_counter() - t0

        def run(mode: str) -> Any:
            return ld.run(f"bench-{next(counter)}", request, plan, mode=mode)

        for mode in ("coalesced", "prepped"):
            results = run(mode)  # warm-up: wire-up, tile tables
            pulls = [r for r in results if r.kind == "pull"]
            moved = sum(r.bytes_moved for r in pulls)
            if moved != nbytes:
                raise RuntimeError(f"{mode}: moved {moved} B, the plan copies {nbytes} B")
            extra = sorted({n for r in results for n in r.notes})
            notes[mode] = (f"{sum(r.descriptors for r in pulls)} descriptors in "
                           f"{sum(r.nixl_requests for r in pulls)} NIXL requests"
                           + (f"; {'; '.join(extra)}" if extra else ""))
        raw = RawNixl(ld, plan)
        raw()
        notes["raw-nixl"] = f"{sum(len(x[2]) for x in raw.posts)} descriptors in {len(raw.posts)} NIXL requests"
        med = interleaved_medians({
            "coalesced": lambda: run("coalesced"),
            "prepped": lambda: run("prepped"),
            "raw-nixl": raw,
            "copyto": lambda: np.copyto(dst, src),
        }, config.transfer_repeats)
    applies = pattern == "fresh" and M >= config.goal_tokens
    out = []
    for mode in MODES:
        goal = TRANSFER_GOAL if mode == "coalesced" else None
        met = (med[mode] <= TRANSFER_LIMIT * med["copyto"]) if goal and applies else None
        what = {"coalesced": "executor, mode coalesced", "prepped": "executor, mode prepped",
                "raw-nixl": "bare NIXL calls, same coalesced lists"}[mode]
        out.append(measurement(
            "transfer", f"transfer/{name}/{pattern}/{pages}/{M}/{mode}", med[mode], "s", med["copyto"],
            "numpy.copyto of the same bytes", goal=goal, met=met,
            note=f"{what}: {notes[mode]}; {nbytes} B, {nbytes / med[mode] / 1e9:.2f} GB/s vs copyto "
                 f"{nbytes / med['copyto'] / 1e9:.2f} GB/s; setup {setup:.2f} s not timed"))
    return out


def run_transfer(config: Config, progress: Progress = quiet) -> list[Measurement]:
    set_nixl_env()
    out: list[Measurement] = []
    counter = iter(range(1 << 30))
    for M in config.transfer_tokens:
        for name in TRANSFER_CASES:
            for pattern in TRANSFER_PATTERNS:
                for pages in PAGE_KINDS:
                    out += _one_case(config, name, pattern, pages, M, progress, counter)
                    gc.collect()  # the case's caches are gone with its frame
    out += descriptor_cost(config.nixl_descs, max(3, config.transfer_repeats), progress)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.transfer --baseline REV``: the executor at git revision ``REV`` next to
    this one, pull and push, interleaved in one process (:mod:`benchmarks.fence_cost`). The full
    transfer section runs with ``python -m benchmarks --only transfer``."""
    import argparse

    from .fence_cost import main as fence_main

    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer")
    parser.add_argument("--baseline", required=True, help="git revision of the executor to time next to this one")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    return fence_main([args.baseline, "--repeats", str(args.repeats)] + (["--json"] if args.json else []))


if __name__ == "__main__":
    import sys

    sys.exit(main())
