"""The executor behind ``kvgeom transfer``: run one preset's transfer with real NIXL agents on this machine
and verify it. Registered under the entry point group ``kvgeom.transfer`` (see pyproject.toml), so the
command line (:mod:`kvgeom.tools.cli`) finds it without kvgeom importing its executor.

    preset.build(tokens, prefix)  ->  Pair + Request
    allocate CPU caches (every rank, both engines) -> simulator fills (P hashes, D stale pattern)
    plan (kvgeom.planning) -> one NIXL agent per rank, all in this process, linked both ways
    pull (D READs; default) or --push (P WRITEs)   -> receive steps with torch
    kvgeom.checking.check_decode on every D byte    -> verdict; exit 0 (verified) or 1

Worked number: the default preset (gqa-tp2-tp4, 100 tokens, 16-token prefix) posts 4 NIXL requests
(one per D rank, each from one P rank) over 6 agents.
"""

from __future__ import annotations

import time
from typing import Any

from kvgeom import DEFAULT_BUDGET, DEFAULT_STAGING_BYTES, PlanBudget, plan_pair
from kvgeom.building import get_preset
from kvgeom.values import engine_line, plan_numbers

from .agent import use_local_defaults
from .errors import TransferFailed
from .local import LocalDeployment, allocate_caches, check_caches, fill_caches, slot_bytes_for, summarize

__all__ = ["transfer_report"]


def transfer_report(preset_name: str, tokens: int, prefix: int, *, layers: int | None = None, push: bool = False,
                    mode: str = "coalesced", strategy: str = "direct", timeout_s: float = 60.0,
                    staging_bytes: int = DEFAULT_STAGING_BYTES, budget: PlanBudget | None = None) -> dict[str, Any]:
    """Run the transfer and return every number ``kvgeom transfer`` prints (one JSON-able dict).

    The plan's totals use ``kvgeom plan --json``'s names (:func:`kvgeom.values.plan_numbers`:
    ``copies``, ``bytes``, ``zeros``, ``wire_descriptors``, ``chunks``, ...); what the transfer did
    is ``bytes_moved``, ``descriptors_posted``, ``nixl_requests``, ``nixl_descs`` (NIXL's count
    after merging), ``bytes_zeroed`` and ``rearranges_applied``; ``staging_slot_bytes`` is one
    ring slot of the endpoints.

    A packed plan (``strategy="packed"``, or ``auto`` choosing it) runs on endpoints whose staging
    slots hold its busiest chunk; ``staging_bytes`` is the planner's chunk capacity. ``budget``
    (default :data:`kvgeom.DEFAULT_BUDGET`) bounds the planning (the CLI has checked the caches'
    size against it before calling)."""
    use_local_defaults()
    budget = DEFAULT_BUDGET if budget is None else budget
    t0 = time.perf_counter()
    preset = get_preset(preset_name)
    pair, request = preset.build(tokens, prefix, layers=layers, budget=budget, strategy=strategy,
                                                  staging_bytes=staging_bytes)
    plan = plan_pair(pair, request, strategy=strategy, staging_bytes=staging_bytes,  # type: ignore[arg-type]
                     budget=budget)
    out: dict[str, Any] = {
        "command": "transfer", "preset": preset_name, "tokens": tokens, "prefix": prefix,
        "layers": preset.default_layers if layers is None else layers,
        "strategy": strategy, "direction": "push" if push else "pull", "mode": mode,
        "prefill": engine_line(pair.prefill), "decode": engine_line(pair.decode),
        "agents": pair.prefill.num_ranks + pair.decode.num_ranks,
        **plan_numbers(plan),  # the plan's totals, under kvgeom plan --json's names
        "staging_slot_bytes": slot_bytes_for(plan),
        "cache_bytes": sum(pair.prefill.regions[i].nbytes for r in range(pair.prefill.num_ranks)
                           for i in pair.prefill.rank_regions(r))
        + sum(pair.decode.regions[i].nbytes for r in range(pair.decode.num_ranks) for i in pair.decode.rank_regions(r)),
        "failure": None, "violations": [], "verified": False, "notes": [n.text for n in plan.notes],
    }
    p_caches = allocate_caches(pair.prefill)
    d_caches = allocate_caches(pair.decode)
    fill_caches(pair, request, p_caches, d_caches)
    t1 = time.perf_counter()
    with LocalDeployment(pair, p_caches, d_caches, telemetry=True, staging_bytes=slot_bytes_for(plan)) as dep:
        t2 = time.perf_counter()
        try:
            results = dep.run("kvgeom-transfer", request, plan, push=push, mode=mode, timeout_s=timeout_s)
        except TransferFailed as e:
            results = []
            out["failure"] = {"reason": e.reason, "detail": e.detail, "request_id": e.request_id,
                              "invalid_blocks": {str(g): list(b) for g, b in e.invalid_blocks.items()}}
        t3 = time.perf_counter()
    done = summarize(results) if results else {"bytes_moved": 0, "descriptors_posted": 0, "nixl_requests": 0,
                                               "nixl_descs": None, "bytes_zeroed": 0, "rearranges_applied": 0,
                                               "pack_s": 0.0, "wire_s": 0.0, "unpack_s": 0.0, "notes": []}
    out["notes"] += done.pop("notes")
    out.update(done)
    violations, checked = check_caches(pair, request, d_caches, max_per_kind=5)
    t4 = time.perf_counter()
    out.update({
        "setup_s": round(t1 - t0, 6), "connect_s": round(t2 - t1, 6), "transfer_s": round(t3 - t2, 6),
        "verify_s": round(t4 - t3, 6), "wall_s": round(t4 - t0, 6), "checked_bytes": checked,
        "violations": [str(v) for v in violations],
        "verified": out["failure"] is None and not violations,
    })
    return out
