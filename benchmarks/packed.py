"""Packed transfers (docs/design.md §12) against ``numpy.copyto`` of the same bytes, with the direct
and staged plans of the same request next to them, all in one run.

    pair at M tokens (fresh blocks): plans direct, staged, packed       descriptors: copies vs wire rows
    LocalDeployment(pair, caches, staging slots = the packed plan's busiest chunk)   NOT timed
    timed, interleaved with numpy.copyto of plan.bytes_copied:
      e2e     LocalDeployment.run(packed plan): slots announced, pack (torch), READ per (D rank, P rank,
              chunk), unpack (torch), zeros
      wire    the packed plan's wire rows alone, bare NIXL READs between the staging rings
      pack    every P rank's pack steps into slot 0;  unpack  every D rank's unpack steps from slot 0
    then direct and staged end to end (fewer repeats: a million descriptors take seconds)

The planning rows include ``plan/packed/syn-cpu-attn-k32-k64/<M>``: vLLM's CPU_ATTN pages
(per-plane layouts, docs/design.md §3.5) from 32- to 64-token blocks, packed against direct.

Goals (the issue's): wire descriptors <= P ranks x D ranks x chunks; wire <= 1.3x copyto; end to
end <= 3.5x copyto; planning a packed 16k-token request <= 5 ms (``plan/packed/<pair>/<M>``).
The staging rings live in numpy memory (huge pages); the caches are ``torch.empty`` (4 KiB pages).
Torch copies on the host run on one thread (kvgeom_nixl.staging.host_copies).

Worked number: the default preset at 16,384 tokens moves ``16384 x 4 layers x 2 x 8 heads x 256 B
= 268,435,456 B``; its direct plan posts 1,048,576 descriptors of 256 B, the packed one 4 wire rows.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from kvgeom import CostModel

from .cases import build_case
from .common import Config, Measurement, Progress, interleaved_medians, measurement, quiet
from .transfer import read_and_wait, set_nixl_env

__all__ = ["PACKED_CASES", "run_packed", "run_packed_planning"]

PACKED_CASES: tuple[tuple[str, int | None], ...] = (
    ("gqa-tp2-tp4", None),  # the default preset, 4 layers
    ("llama3-70b-tp8-tp4", 8),
    ("syn-nhd-tp2-hnd-tp4", 8),  # Llama-70B-like TP2 NHD -> TP4 HND
)
PACKED_PLAN_PRESETS = ("gqa-tp2-tp4", "llama3-70b-tp8-tp4", "llama3-70b-tp4-tp8", "deepseek-v3-tp8-tp1",
                       "qwen-swa-tp2-tp4", "llama3-70b-pp2tp4-tp8", "deepseek-v3-tp8-dcp8", "deepseek-v3-dcp4-dcp2")
WIRE_GOAL, WIRE_LIMIT = "packed wire <= 1.3x numpy.copyto", 1.3
E2E_GOAL, E2E_LIMIT = "packed end to end <= 3.5x numpy.copyto", 3.5
DESC_GOAL = "wire descriptors <= P ranks x D ranks x chunks"
PLAN_GOAL, PLAN_LIMIT = "planning a packed 16k-token request <= 5 ms", 5e-3


class _Wire:
    """The packed plan's wire rows as bare NIXL READs between the deployment's staging rings (slot 0)."""

    def __init__(self, ld: Any, plan: Any) -> None:
        from kvgeom_nixl.lowering import copy_descs

        w = plan.wire
        self.posts: list[tuple[Any, np.ndarray, np.ndarray, str]] = []
        self.targets = [p.agent for p in ld.p]
        for d in ld.d:
            for p in ld.p:
                sel = (w.d_rank == d.rank) & (w.p_rank == p.rank)
                if not sel.any():
                    continue
                zero = np.zeros(int(sel.sum()), np.int64)
                local = copy_descs(np.array([d.staging.addr], np.uint64), np.array([0], np.uint64), zero,
                                   w.d_offset[sel], w.nbytes[sel])
                remote = copy_descs(np.array([p.staging.addr], np.uint64), np.array([0], np.uint64), zero,
                                    w.p_offset[sel], w.nbytes[sel])
                self.posts.append((d.agent, local, remote, p.name))

    def __call__(self) -> None:
        read_and_wait(self.posts, self.targets, b"bench-wire")


def _steps(endpoints: list[Any], plan: Any, pack: bool) -> None:
    from kvgeom_nixl.staging import run_steps

    steps = plan.packs if pack else plan.unpacks
    for ep in endpoints:
        mine = [s for s in steps if s.rank == ep.rank]
        for chunk in sorted({s.chunk for s in mine}):
            run_steps([s for s in mine if s.chunk == chunk], ep.memory.byte_views(), ep.staging, 0, pack=pack)


def _one_pair(config: Config, name: str, layers: int | None, progress: Progress, counter: Any) -> list[Measurement]:
    from kvgeom_nixl.local import LocalDeployment, allocate_caches, slot_bytes_for

    M = config.packed_tokens
    case = build_case(name, M, layers=layers)
    pair, request = case.pair, case.fresh()
    plans = {s: pair.plan(request, strategy=s) for s in ("direct", "staged", "packed")}
    packed = plans["packed"]
    nbytes = packed.bytes_copied
    bound = pair.prefill.num_ranks * pair.decode.num_ranks * len(packed.chunks)
    progress(f"packed {name} M={M}: {nbytes / 2**20:.0f} MiB; direct {len(plans['direct'].copies):,} copies, staged "
             f"{len(plans['staged'].copies):,} (+{len(plans['staged'].rearranges)} rearranges), packed "
             f"{len(packed.wire)} wire rows in {len(packed.chunks)} chunks")
    p_caches, d_caches = allocate_caches(pair.prefill), allocate_caches(pair.decode)
    for regs in p_caches + d_caches:
        for t in regs:
            t.fill_(1)
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    out: list[Measurement] = []
    with LocalDeployment(pair, p_caches, d_caches, staging_bytes=slot_bytes_for(packed)) as ld:
        def run(plan: Any) -> Any:
            return ld.run(f"packed-bench-{next(counter)}", request, plan)

        results = run(packed)  # warm-up: UCX wire-up, first touch of the rings
        moved = sum(r.bytes_moved for r in results if r.kind == "pull")
        if moved != nbytes:
            raise RuntimeError(f"packed: moved {moved} B, the plan has {nbytes} B")
        wire = _Wire(ld, packed)
        wire()
        for ep in ld.endpoints:
            if ep.staging is None:
                raise RuntimeError("packed: an endpoint without staging rings")
            for s in range(ep.staging.slots):
                ep.staging.view(s).fill_(0)  # first touch of every slot before timing
        med = interleaved_medians({
            "e2e": lambda: run(packed),
            "wire": wire,
            "pack": lambda: _steps(ld.p, packed, True),
            "unpack": lambda: _steps(ld.d, packed, False),
            "copyto": lambda: np.copyto(dst, src),
        }, config.transfer_repeats)
        base = med["copyto"]
        baselines = {}
        for strategy in ("direct", "staged"):
            if plans[strategy].packed or (strategy == "staged" and not plans[strategy].rearranges):
                continue
            run(plans[strategy])  # warm-up
            baselines[strategy] = interleaved_medians({strategy: functools.partial(run, plans[strategy]),
                                                       "copyto": lambda: np.copyto(dst, src)},
                                                      config.packed_baseline_repeats)
    counts = (f"direct {len(plans['direct'].copies):,} copies, staged {len(plans['staged'].copies):,} copies + "
              f"{len(plans['staged'].rearranges)} rearranges, packed {len(packed.wire)} wire rows in "
              f"{len(packed.chunks)} chunk(s) (bound {bound}); {nbytes} B")
    key = f"transfer/packed/{name}/{M}"
    judged = M >= config.goal_tokens
    out.append(measurement("transfer", f"{key}/descriptors", len(packed.wire), "descriptors",
                           max(1, len(plans["direct"].copies)), "the direct plan's descriptors (copies)",
                           goal=DESC_GOAL, met=len(packed.wire) <= bound, note=counts))
    for part, goal, limit in (("wire", WIRE_GOAL, WIRE_LIMIT), ("e2e", E2E_GOAL, E2E_LIMIT), ("pack", None, 0),
                              ("unpack", None, 0)):
        out.append(measurement("transfer", f"{key}/{part}", med[part], "s", base, "numpy.copyto of the same bytes",
                               goal=goal, met=(med[part] <= limit * base) if goal and judged else None,
                               note=f"{nbytes / med[part] / 1e9:.2f} GB/s vs copyto {nbytes / base / 1e9:.2f} GB/s; "
                                    + counts))
    for strategy, bm in baselines.items():
        out.append(measurement("transfer", f"transfer/{strategy}/{name}/{M}", bm[strategy], "s", bm["copyto"],
                               "numpy.copyto of the same bytes",
                               note=f"{len(plans[strategy].copies):,} descriptors; end to end with the executor"))
    copied = 2 * nbytes / (med["pack"] + med["unpack"])
    out.append(measurement("transfer", f"packed/copy-bandwidth/{name}", copied / 1e9, "GB/s",
                           CostModel().copy_bytes_per_second / 1e9, "planner CostModel.copy_bytes_per_second default",
                           note=f"pack {nbytes / med['pack'] / 1e9:.2f} GB/s, unpack {nbytes / med['unpack'] / 1e9:.2f} "
                                "GB/s (torch, one thread, 4 KiB-page caches, huge-page rings)"))
    return out


def run_packed_planning(config: Config, progress: Progress = quiet) -> list[Measurement]:
    """Planning a packed request at ``config.packed_tokens``, against planning it direct (same run)."""
    from kvgeom.building import get_preset

    out = []
    M = config.packed_tokens
    for name in PACKED_PLAN_PRESETS:
        pair, request = get_preset(name).build(M)
        progress(f"plan packed {name} M={M}")
        pair.plan(request, strategy="packed")
        # not interleaved: a direct plan frees hundreds of MiB, which the next packed plan would pay for
        med = {s: interleaved_medians({s: functools.partial(pair.plan, request, strategy=s)},
                                      config.plan_repeats)[s] for s in ("packed", "direct")}
        plan = pair.plan(request, strategy="packed")
        steps = sum(len(s.pages) + len(s.regions) for s in plan.packs + plan.unpacks)
        out.append(measurement("plan", f"plan/packed/{name}/{M}", med["packed"], "s", med["direct"],
                               "planning the same request direct", goal=PLAN_GOAL,
                               met=med["packed"] <= PLAN_LIMIT if M >= config.goal_tokens else None,
                               note=f"{med['packed'] * 1e3:.2f} ms; {len(plan.chunks)} chunks, "
                                    f"{len(plan.packs) + len(plan.unpacks)} steps listing {steps} pages and layer "
                                    f"entries, {len(plan.wire)} wire rows"))
    out.append(_per_plane_planning(config, progress))
    return out


def _per_plane_planning(config: Config, progress: Progress) -> Measurement:
    """``plan/packed/syn-cpu-attn-k32-k64/<M>``: per-plane pages between block sizes (docs/design.md §3.5),
    where the direct plan moves every K element on its own (~16.9M rows at 16k tokens), planned packed
    (the reference planner: packed plans are never compiled) against planned direct once on the
    compiled path (its fastest; the reference path takes about 5x longer)."""
    import gc

    M = config.packed_tokens
    name = "syn-cpu-attn-k32-k64"
    case = build_case(name, M)
    pair, request = case.pair, case.fresh()
    progress(f"plan packed {name} M={M}")
    packed = functools.partial(pair.plan, request, strategy="packed", budget=None)
    plan = packed()
    med = interleaved_medians({"packed": packed}, config.plan_repeats)["packed"]
    steps = sum(len(s.pages) + len(s.regions) for s in plan.packs + plan.unpacks)
    compiled = pair.compile()
    gc.collect()
    t0 = time.perf_counter()
    direct = compiled.plan(request, strategy="direct", budget=None)
    direct_s = time.perf_counter() - t0
    rows = len(direct.copies)
    del direct
    gc.collect()
    return measurement("plan", f"plan/packed/{name}/{M}", med, "s", direct_s,
                       "planning the same request direct (compiled, once)",
                       note=f"packed {med * 1e3:.1f} ms: {len(plan.chunks)} chunks, {len(plan.packs)} packs and "
                            f"{len(plan.unpacks)} unpacks listing {steps} pages and layer entries, {len(plan.wire)} "
                            f"wire rows; direct {direct_s:.2f} s: {rows:,} copy rows")


def run_packed(config: Config, progress: Progress = quiet) -> list[Measurement]:
    set_nixl_env()
    import gc

    out = run_packed_planning(config, progress)
    counter = iter(range(1 << 30))
    for name, layers in PACKED_CASES:
        t0 = time.perf_counter()
        out += _one_pair(config, name, layers, progress, counter)
        progress(f"packed {name}: {time.perf_counter() - t0:.1f} s")
        gc.collect()
    return out
