"""Hash every preset's plans, pair files and reprs: ``python -m benchmarks.plan_hashes > hashes.txt``
on two trees, then ``diff``: an identical output proves a change left every existing plan as it was
(docs/design.md §3.5: plain layouts plan exactly as before per-plane layouts existed).

One line per (preset, strategy, path): the sha256 of the plan's copy and zero columns, rearranges,
staging steps, wire rows, chunks and note texts; reference path and compiled path (second request)
hashed apart. Then one line per preset for the pair file (``kvgeom.tools.serialize.dumps``) and the
engines' reprs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvgeom.building.presets import PRESETS
from kvgeom.planning.transfer import plan_reference
from kvgeom.tools.serialize import dumps


def plan_digest(plan: Any) -> str:
    h = hashlib.sha256()
    for cols in (plan.copies, plan.zeros):
        for name in cols._names:
            h.update(name.encode())
            h.update(getattr(cols, name).tobytes())
    for part in (plan.rearranges, plan.packs, plan.unpacks, plan.chunks, plan.staging_bytes,
                 plan.copies_before_coalescing, plan.zeros_before_coalescing):
        h.update(repr(part).encode())
    for name in ("chunk", "p_rank", "p_offset", "d_rank", "d_offset", "nbytes"):
        h.update(getattr(plan.wire, name).tobytes())
    for n in plan.notes:
        h.update(f"{n.kind}:{n.text}".encode())
    return h.hexdigest()[:16]


def main() -> None:
    for name, preset in sorted(PRESETS.items()):
        if not preset.pairable:
            continue
        pair, request = preset.build()
        print(f"{name} pair-file {hashlib.sha256(dumps(pair).encode()).hexdigest()[:16]} "
              f"repr {hashlib.sha256((repr(pair.prefill) + repr(pair.decode)).encode()).hexdigest()[:16]}")
        for strategy in ("direct", "staged", "auto", "packed"):
            ref = plan_reference(pair, request, strategy=strategy)  # type: ignore[arg-type]
            print(f"{name} {strategy} reference {plan_digest(ref)}")
            if strategy != "packed":
                compiled = pair.compile().plan(request, strategy=strategy)  # type: ignore[arg-type]
                print(f"{name} {strategy} compiled {plan_digest(compiled)}")


if __name__ == "__main__":
    main()
