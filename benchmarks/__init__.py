"""kvgeom benchmarks: each cost measured next to its physical limit in the same run, as a ratio.

Run from the repository root::

    python -m benchmarks                  # full run (< 15 min on a 2-core machine), a table on stdout
    python -m benchmarks --quick          # smoke run (< 60 s): smaller sizes, fewer repeats, no 128k
    python -m benchmarks --json           # a JSON list on stdout, one object per measurement
    python -m benchmarks --only plan,descriptors     # sections: plan, memory, descriptors, transfer, receive, packed

    python -m benchmarks.plan_profile llama3-70b-tp8-tp4 16384       # cProfile of one planning case

Progress lines go to stderr. The transfer section needs torch and nixl, the receive section torch
(``pip install -e '.[nixl]'``); without them they are skipped with the reason printed.

    section       value                                   baseline (same unit)                        goal
    plan          compiled.plan(request) and              numpy writes the plan's 7+4 columns once    compiled <= 2x at
                  plan_reference per request, s                                                       M >= 16k
                  a 1-token request (fixed cost), s       -                                           <= 100 us
                  compiling the pair, s                   -                                           <= 50 ms
                  exponent of time over tokens            1 (linear)                                  <= 1.1
    memory        tracemalloc peak of one plan, MiB       the plan's own column bytes                 compiled <= 1.2x
    descriptors   kvgeom's coalesced copies               one per (region, kernel block, P rank)      -
    transfer      LocalDeployment.run, s (coalesced,      numpy.copyto of the same bytes              coalesced <= 1.5x
                  prepped), bare NIXL calls (raw-nixl)                                                on fresh, M >= 16k
                  us per NIXL descriptor                  planner CostModel default 1.5 us            -
    receive       apply_rearranges / apply_zeros, s       torch clone of the touched bytes            -
                  rearrange bandwidth, GB/s               planner CostModel default 1.5 GB/s          -
    packed        packed plan per request, s              planning it direct                          <= 5 ms at 16k
                  wire rows                               the direct plan's copies                    <= P x D x chunks
                  packed wire / pack / unpack / end to    numpy.copyto of the same bytes              wire <= 1.3x,
                  end, s; direct and staged end to end                                                e2e <= 3.5x

Every JSON object has ``name``, ``value``, ``unit``, ``baseline``, ``ratio`` (= value / baseline),
plus ``section``, ``baseline_name``, ``goal``, ``met`` (true/false, or null where no goal applies at
that size) and ``note``. Names: ``plan/<pair>/<fresh|scattered>/<M>`` (compiled),
``.../<M>/reference``, ``.../<M>/vs-reference`` (compiled over reference), ``plan/<pair>/fixed``,
``compile/<pair>``, ``plan/<pair>/exponent`` (unit ``exponent``: its ratio is the exponent itself,
<= 0 when the time does not grow), ``memory/<pair>/<pattern>/<M>`` (and ``/reference``),
``descriptors/<pair>/<pattern>/<M>``,
``descriptors/<pattern>/geomean``, ``transfer/<pair>/<pattern>/<4k|thp caches>/<M>/<mode>``,
``nixl/per-descriptor/<post|repost>``, ``receive/<step>/<M>``, ``receive/rearrange-bandwidth``,
``plan/packed/<pair>/<M>``, ``transfer/packed/<pair>/<M>/<descriptors|wire|e2e|pack|unpack>``,
``transfer/<direct|staged>/<pair>/<M>``, ``packed/copy-bandwidth/<pair>``.

Worked number: ``plan/llama3-70b-tp8-tp4/fresh/16384`` planning 1,310,720 copy rows in 9.2 ms
against 7.8 ms for numpy to write 7 columns of that many int64 values is a ratio of 1.17 (the
reference path: 51 ms, 6.5x).
"""

from __future__ import annotations

from collections.abc import Sequence

from .common import SECTIONS, Config, Measurement, Progress, quiet

__all__ = ["Config", "Measurement", "SECTIONS", "run", "render_table", "to_json_list"]


def run(config: Config, only: Sequence[str] = SECTIONS, progress: Progress = quiet) -> list[Measurement]:
    """Run the chosen sections in :data:`SECTIONS` order; NIXL sections skip (via ``progress``)
    when torch or nixl cannot be imported."""
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    import gc

    out: list[Measurement] = []
    for section in SECTIONS:
        if section not in only:
            continue
        gc.collect()
        if section == "plan":
            from .planning import run_planning

            out += run_planning(config, progress)
        elif section == "memory":
            from .planning import run_memory

            out += run_memory(config, progress)
        elif section == "descriptors":
            from .descriptors import run_descriptors

            out += run_descriptors(config, progress)
        else:
            from .transfer import nixl_missing

            why = nixl_missing() if section in ("transfer", "packed") else nixl_missing(("torch", "kvgeom_nixl.receive"))
            if why is not None:
                progress(f"SKIP {section}: {why} (pip install -e '.[nixl]')")
                continue
            if section == "transfer":
                from .transfer import run_transfer

                out += run_transfer(config, progress)
            elif section == "packed":
                from .packed import run_packed

                out += run_packed(config, progress)
            else:
                from .receive import run_receive

                out += run_receive(config, progress)
    return out


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1e5 or a < 1e-3:
        return f"{x:.3g}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 1:
        return f"{x:.3g}"
    return f"{x:.3g}"


def render_table(measurements: Sequence[Measurement], *, notes: bool = False) -> str:
    """A fixed-width table, rows grouped by (section, baseline), then the goals met and missed."""
    head = ("name", "value", "unit", "baseline", "ratio", "goal")
    cells = {id(m): (m.name, _fmt(m.value), m.unit, _fmt(m.baseline), _fmt(m.ratio),
                     "" if m.met is None else ("met" if m.met else "MISSED")) for m in measurements}
    widths = [max([len(h)] + [len(c[i]) for c in cells.values()]) for i, h in enumerate(head)]

    def line(cols: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, 2, 5) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cols, widths))).rstrip()

    blocks: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        blocks.setdefault((m.section, m.baseline_name), []).append(m)
    lines = [line(head), "  ".join("-" * w for w in widths)]
    for (section, baseline), ms in blocks.items():
        lines.append(f"[{section}] baseline: {baseline}")
        for m in ms:
            lines.append(line(cells[id(m)]))
            if notes and m.note:
                lines.append(f"    {m.note}")
        lines.append("")
    judged = [m for m in measurements if m.met is not None]
    missed = [m for m in judged if not m.met]
    lines.append(f"goals: {len(judged) - len(missed)} of {len(judged)} met")
    for g in sorted({m.goal for m in judged if m.goal}):
        ms = [m for m in judged if m.goal == g]
        bad = [m for m in ms if not m.met]
        lines.append(f"  {g}: {len(ms) - len(bad)}/{len(ms)} met" + (
            "; missed: " + ", ".join(f"{m.name} ({_fmt(m.ratio)}x)" for m in bad) if bad else ""))
    return "\n".join(lines)


def to_json_list(measurements: Sequence[Measurement]) -> list[dict[str, object]]:
    return [m.as_dict() for m in measurements]
