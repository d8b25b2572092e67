"""The ``kvgeom`` command line: plan and verify a transfer, list presets, run one with NIXL.

    kvgeom plan [--preset NAME] [--tokens M] [--prefix S] [--strategy direct|staged|auto|packed]
                [--staging-bytes N] [--layers L] [--json] [--pair FILE] [--svg FILE | --png FILE]
                [--budget-mb MB] [--max-work N] [--max-steps N]
    kvgeom presets
    kvgeom transfer [--preset NAME] [--tokens M] [--prefix S] [--strategy ...] [--staging-bytes N] [--push]
                    [--mode coalesced|prepped] [--json] [--timeout SEC] [--budget-mb MB] [--max-work N] [--max-steps N]
    kvgeom fuzz [...] [--budget-mb MB] [--max-work N] [--max-steps N]

    argv --> COMMANDS[name] --> add_arguments(parser) --> run(args) --> exit status
                                                          0 ok, 1 verification failed or internal error,
                                                          2 bad input / unpairable / missing extra

Worked number: ``kvgeom plan`` (preset ``gqa-tp2-tp4``, M=100, S=16) moves tokens [16, 100):
84 tokens x 4 layers x 2 planes x 8 heads x 256 B = 1,376,256 B over the four D ranks.

Bounded work (docs/design.md §14): every input is checked before the work it sizes. Output paths
(``--svg``, ``--png``) are opened before planning; pair files are read to at most 4 MiB; the plan
is estimated from the request's shape before any block list is built, and refused over the budget
(``--budget-mb``, default 4096; ``--max-work`` and ``--max-steps`` raise the other two limits of
:class:`~kvgeom.PlanBudget`) with exit 2, and so is a simulation (``plan``) or cache and
staging-ring allocation (``transfer``) larger than the budget; ``--timeout`` must be finite and positive.

Adding a subcommand: write ``add_arguments(parser)`` and ``run(args) -> int`` and add one
``Command`` to :data:`COMMANDS`. Arguments never need an optional extra, so ``--help`` always
works; a command that needs one imports it when it runs and says which extra is missing (exit 2):
``fuzz`` imports :mod:`kvgeom.tools.fuzz` (hypothesis) when it runs. ``transfer`` runs the
executor registered under the entry point group ``kvgeom.transfer`` (``kvgeom_nixl`` registers
itself there), so kvgeom never imports the executor that is built on it. Importing this module
never imports torch, nixl, matplotlib or hypothesis.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

import attrs

from ..building.presets import DEFAULT_PRESET, PRESETS, Preset, get_preset
from ..building.requests import fresh_request, fresh_shape
from ..checking.report import Report
from ..checking.simulator import simulate
from ..errors import IncompatibleGeometry, KvGeomError, MissingExtra, install_hint
from ..planning.choose import STRATEGIES
from ..planning.packed import DEFAULT_STAGING_BYTES
from ..planning.transfer import Pair, check_budget, plan_pair
from ..show.drawing import draw
from ..values.engine import EngineGeometry, engine_line
from ..values.fields import check_seconds
from ..values.model import StateSpec
from ..values.pair import pairable
from ..values.plan import TransferPlan, plan_numbers, plan_rank_rows
from ..values.request import Request
from ..values.text import format_bytes, text_table
from .limits import (
    budget_arguments,
    budget_of,
    check_memory,
    check_simulation,
    engine_bytes,
    simulation_bytes,
    simulation_steps,
)
from .output import OutputFile, check_drawing_path
from .serialize import load_pair_file

__all__ = ["main", "build_parser", "resolve_preset", "Command", "COMMANDS", "TRANSFER_ENTRY_POINTS", "OutputFile",
           "simulation_bytes", "simulation_steps"]
NIXL_HINT = install_hint("nixl")  # from a wheel: pip install "kvgeom[nixl]"; from a checkout: pip install -e "<it>[nixl]"
MAX_LISTED = 10  # violations and notes shown in the human summary (--json lists all)


@attrs.frozen
class Command:
    """A subcommand: its help line, how it declares its arguments, and how it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class _Unavailable(MissingExtra):
    """An optional part (extra, module) the command needs is not installed."""


# ---- shared helpers ---------------------------------------------------------------------------------

def _print(text: str = "") -> None:
    print(text, flush=False)


def _json_out(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True, default=str))


def _preset_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET, metavar="NAME",
                   help=f"a named P/D pair (default {DEFAULT_PRESET}; `kvgeom presets` lists them)")
    p.add_argument("--tokens", type=int, default=None, metavar="M",
                   help="prompt tokens P computes and sends (default: the preset's)")
    p.add_argument("--prefix", type=int, default=None, metavar="S",
                   help="tokens D already holds (prefix-cache hit, on a D block boundary; default: the preset's)")
    p.add_argument("--layers", type=int, default=None, metavar="L",
                   help="layers per group (default: the preset's; fewer is faster)")
    p.add_argument("--strategy", choices=STRATEGIES, default="direct",
                   help="direct: every copy lands in place; staged: copy pages whole, then rearrange; "
                        "packed: gather on P, one wire row per (P rank, D rank, chunk), scatter on D; "
                        "auto: choose by cost (default direct)")
    p.add_argument("--staging-bytes", type=int, default=DEFAULT_STAGING_BYTES, metavar="N",
                   help="packed: the most bytes one chunk stages on one rank (one ring slot; default "
                        f"{DEFAULT_STAGING_BYTES >> 20} MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    budget_arguments(p)


def resolve_preset(args: argparse.Namespace) -> tuple[Preset, int, int]:
    """The preset, M and S that ``--preset``/``--tokens``/``--prefix`` name (shared with ``kvgeom transfer``).

    Missing ``--tokens``/``--prefix`` take the preset's defaults (its prefix only if it fits the tokens);
    build with ``preset.build(tokens, prefix, layers=args.layers)``.
    """
    preset = get_preset(args.preset)
    tokens, prefix = preset.resolve(args.tokens, args.prefix)  # the rule Preset.build uses too
    return preset, tokens, prefix


def _reason_dict(e: KvGeomError) -> dict[str, Any]:
    return {"path": e.path, "message": e.message, "actual": e.actual, "expected": e.expected, "fix": e.fix,
            "text": str(e)}


# ---- kvgeom plan --------------------------------------------------------------------------------------

def _plan_arguments(p: argparse.ArgumentParser) -> None:
    _preset_arguments(p)
    p.add_argument("--pair", metavar="FILE", default=None,
                   help="plan a pair file ({prefill, decode, request} JSON, e.g. from `kvgeom fuzz`) instead of "
                        "a preset")
    draw = p.add_mutually_exclusive_group()
    draw.add_argument("--svg", metavar="FILE", default=None, help="also draw the transfer to an SVG file")
    draw.add_argument("--png", metavar="FILE", default=None, help="also draw the transfer to a PNG file")


def _load_pair(args: argparse.Namespace) -> tuple[dict[str, Any], Pair | None, Any, tuple[EngineGeometry, ...]]:
    """(header, pair or None when unpairable, request, (prefill, decode) when known).

    The budget is checked before any request is built: a fresh request by its shape, a pair
    file's request (bounded by the file's size) by itself."""
    budget = budget_of(args)
    if args.pair is not None:
        try:
            pair, request = load_pair_file(args.pair)
        except KvGeomError as e:
            if isinstance(e.__cause__, IncompatibleGeometry):
                raise e.__cause__ from None
            raise
        header = {"pair_file": args.pair, "preset": None}
        check_simulation(pair, budget, "describe engines with fewer or smaller pages, layers or ranks")
        if request is None:
            if args.tokens is None:  # no silent default: the user says which request to plan
                raise KvGeomError("--pair", f"pair file {args.pair!r} holds two engines and no request",
                                  actual="no request", expected="a request in the file, or --tokens",
                                  fix="pass --tokens M (and --prefix S) to plan a fresh request on its engines")
            tokens = args.tokens
            prefix = args.prefix or 0
            hybrid = any(isinstance(g, StateSpec) for g in pair.model.groups)
            decode_tokens = tokens + 1 if hybrid else tokens
            shape = fresh_shape(pair, tokens, decode_tokens=decode_tokens, prefix_hit_tokens=prefix)
            check_budget(pair, shape, args.strategy, staging_bytes=args.staging_bytes, budget=budget)
            request = fresh_request(pair, tokens, decode_tokens=decode_tokens, prefix_hit_tokens=prefix)
            pair.check_request(request)
        header.update(tokens=request.computed_tokens, prefix=request.prefix_hit_tokens, layers=None)
        return header, pair, request, (pair.prefill, pair.decode)
    preset, tokens, prefix = resolve_preset(args)
    header = {"preset": preset.name, "pair_file": None, "tokens": tokens, "prefix": prefix,
              "layers": args.layers if args.layers is not None else preset.default_layers}
    prefill, decode = preset.geometries(tokens, prefix, layers=args.layers)
    if not pairable(prefill, decode):
        return header, None, None, (prefill, decode)
    check_simulation(Pair(prefill, decode), budget, "plan fewer --tokens or --layers")
    pair, request = preset.build(tokens, prefix, layers=args.layers, budget=budget, strategy=args.strategy,
                                 staging_bytes=args.staging_bytes)
    return header, pair, request, (pair.prefill, pair.decode)


def _label(header: dict[str, Any]) -> str:
    src = f"preset {header['preset']}" if header.get("preset") else f"pair file {header.get('pair_file')}"
    return f"{src}: M={header['tokens']} tokens, prefix S={header['prefix']}"


def _run_plan(args: argparse.Namespace) -> int:
    if args.svg or args.png:
        check_drawing_path("--svg" if args.svg else "--png", args.svg or args.png)
    out = OutputFile("--svg" if args.svg else "--png", args.svg or args.png) if (args.svg or args.png) else None
    try:
        return _plan_and_report(args, out)
    finally:
        if out is not None and not out.written:
            out.abandon()


def _plan_and_report(args: argparse.Namespace, out: OutputFile | None) -> int:
    try:
        header, pair, request, engines = _load_pair(args)
    except IncompatibleGeometry as e:  # a pair file whose engines cannot be paired
        return _report_unpairable({"pair_file": args.pair, "preset": None}, list(e.reasons), None, args)
    header["strategy"] = args.strategy
    if pair is None:
        compat = pairable(*engines)
        return _report_unpairable(header, list(compat.reasons), engines, args)
    budget = budget_of(args)
    plan = plan_pair(pair, request, strategy=args.strategy, staging_bytes=args.staging_bytes, budget=budget)
    # planning twice lets the simulator check determinism (docs/design.md §4.2 (invariant 6))
    report = simulate(pair, request, plan, replan=plan_pair(pair, request, strategy=args.strategy,
                                                            staging_bytes=args.staging_bytes, budget=budget))
    if out is not None:
        _draw(plan, pair, request, out, "svg" if args.svg else "png")
    verified = report.ok
    if args.json:
        _json_out(_plan_json(header, pair, plan, report, verified))
    else:
        _print_plan(header, pair, plan, report, verified)
        if args.svg or args.png:
            _print(f"drawing: {args.svg or args.png}")
    return 0 if verified else 1


def _report_unpairable(header: dict[str, Any], reasons: Sequence[KvGeomError],
                       engines: tuple[EngineGeometry, ...] | None, args: argparse.Namespace) -> int:
    if args.json:
        out = {**header, "pairable": False, "reasons": [_reason_dict(r) for r in reasons], "copies": None,
               "copies_before_coalescing": None, "bytes": None, "zeros": None, "violations": [], "verified": False,
               "notes": []}
        if engines:
            out.update(prefill=engine_line(engines[0]), decode=engine_line(engines[1]))
        _json_out(out)
    else:
        if header.get("tokens") is not None:
            _print(f"kvgeom plan: {_label(header)}")
        if engines:
            _print(f"  P  {engine_line(engines[0])}")
            _print(f"  D  {engine_line(engines[1])}")
        _print(f"not pairable ({len(reasons)} reason{'s' if len(reasons) != 1 else ''}):")
        for r in reasons:
            _print(f"  - {r}")
    return 2


def _plan_json(header: dict[str, Any], pair: Pair, plan: TransferPlan, report: Report,
               verified: bool) -> dict[str, Any]:
    rows = plan_rank_rows(plan)
    per_rank = [{"d_rank": r[0], "p_ranks": list(plan.sources_of(r[0])), "copies": r[2], "bytes": r[3],
                 "zeros": r[4], "zero_bytes": r[5], "rearranged_pages": r[6]} for r in rows[1:]]
    sim = report.to_dict()
    return {
        **header,
        "pairable": True,
        "planned": True,
        "prefill": engine_line(pair.prefill),
        "decode": engine_line(pair.decode),
        **plan_numbers(plan),
        "per_decode_rank": per_rank,
        "violations": sim["violations"],
        "verified": verified,
        "simulated": True,
        "simulation": sim,
        "notes": [n.text for n in plan.notes],
        "note_kinds": [n.kind.value for n in plan.notes],
    }


PLAN_LEGEND = """\
legend: K = tokens per kernel page, ppl = kernel pages per logical block (logical = K x ppl tokens);
  copies / wire rows = NIXL descriptors (one contiguous byte range each); zero ranges = D bytes set to 0
  (tokens D lists that P never computed); rearranged pages = D kernel pages permuted in place after a staged
  copy (unpacked pages: D pages an unpack step writes); aligned segments = token runs whose bytes are
  affine on both sides (cut at both sides' page and DCP boundaries); checked = every byte of D's cache
  compared with what it must hold (moved, zeroed, and the bytes that must stay untouched), so it exceeds moved."""


def _print_plan(header: dict[str, Any], pair: Pair, plan: TransferPlan, report: Report, verified: bool) -> None:
    _print(f"kvgeom plan: {_label(header)}, strategy {header['strategy']}")
    _print(f"  P  {engine_line(pair.prefill)}")
    _print(f"  D  {engine_line(pair.decode)}")
    rows = plan_rank_rows(plan)
    rows.append(["total", "", plan.descriptors, plan.bytes_copied, len(plan.zeros), plan.bytes_zeroed,
                 sum(int(r[6]) for r in rows[1:])])
    _print(text_table(rows))
    before = plan.copies_before_coalescing
    if plan.packed:
        used_p, used_d = plan.staging_used("prefill"), plan.staging_used("decode")
        _print(f"descriptors: {len(plan.wire):,} wire rows in {len(plan.chunks)} chunk"
               f"{'s' if len(plan.chunks) != 1 else ''} ({len(plan.packs)} pack and {len(plan.unpacks)} unpack "
               f"steps); staging up to {format_bytes(int(used_p.max(initial=0)))} per P rank, "
               f"{format_bytes(int(used_d.max(initial=0)))} per D rank")
    else:
        _print(f"descriptors: {before:,} before coalescing, {len(plan.copies):,} after" if before >= 0
               else f"descriptors: {len(plan.copies):,}")
    _print(f"moved {format_bytes(plan.bytes_copied)}, zeroed {format_bytes(plan.bytes_zeroed)}")
    notes = [n.text for n in plan.notes]
    if notes:
        _print("notes:")
        for n in notes[:MAX_LISTED]:
            _print(f"  - {n}")
        if len(notes) > MAX_LISTED:
            _print(f"  ... {len(notes) - MAX_LISTED} more (--json lists all)")
    _print(PLAN_LEGEND)  # before the verdict, which stays the last line
    checked_text = f", {format_bytes(report.bytes_checked)} checked"
    if verified:
        _print(f"verdict: OK (simulator: 0 violations{checked_text})")
        return
    violations = list(report.violations)
    counts = {str(k): int(n) for k, n in report.counts.items() if n}
    total = sum(counts.values())
    kinds = ", ".join(f"{k} x{n}" for k, n in counts.items())
    _print(f"verdict: FAILED (simulator: {total} violation{'s' if total != 1 else ''}"
           f"{' (' + kinds + ')' if kinds else ''}{checked_text})")
    for v in violations[:MAX_LISTED]:
        _print(f"  - {v}")
    if len(violations) > MAX_LISTED:
        _print(f"  ... {len(violations) - MAX_LISTED} more listed (--json lists them)")


def _draw(plan: TransferPlan, pair: Pair, request: Request, out: OutputFile, fmt: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise _Unavailable(f"--{fmt}", "drawing needs matplotlib, which is not installed",
                           fix=install_hint("notebook"))
    import matplotlib

    matplotlib.use("Agg")
    fig = draw(plan, pair, request)
    try:
        fig.savefig(out.file, format=fmt, bbox_inches="tight")
        out.file.flush()
    except OSError as e:
        raise KvGeomError(out.flag, f"cannot write {out.path!r}: {e.strerror or e}", actual=out.path,
                          fix="pass a file on a device with room") from None
    out.done()


# ---- kvgeom presets -----------------------------------------------------------------------------------

def _presets_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the presets as JSON")


def _run_presets(args: argparse.Namespace) -> int:
    if args.json:
        _json_out({"default": DEFAULT_PRESET, "presets": [
            {"name": p.name, "description": p.description, "pairable": p.pairable, "hybrid": p.hybrid,
             "default_tokens": p.default_tokens, "default_prefix": p.default_prefix,
             "default_layers": p.default_layers} for p in PRESETS.values()]})
        return 0
    rows: list[list[Any]] = [["name", "M", "S", "layers", "description"]]
    for p in PRESETS.values():
        mark = " (default)" if p.name == DEFAULT_PRESET else ""
        rows.append([p.name + mark, p.default_tokens, p.default_prefix, p.default_layers, p.description])
    _print(text_table(rows, indent=""))
    _print("\nM: default --tokens, S: default --prefix, layers: per group (--layers). "
           "Use: kvgeom plan --preset NAME [--tokens M]")
    return 0


# ---- kvgeom transfer ----------------------------------------------------------------------------------

def _transfer_arguments(p: argparse.ArgumentParser) -> None:
    _preset_arguments(p)
    p.add_argument("--push", action="store_true", help="P writes into D (default: D pulls with READs)")
    p.add_argument("--mode", choices=("coalesced", "prepped"), default="coalesced",
                   help="coalesced: per-request descriptor lists of the plan's copies; prepped: prepared "
                        "per-region tables + index lists (default coalesced)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SEC",
                   help="give up on the transfer after SEC seconds (default 60)")


def _missing_modules(names: Sequence[str]) -> list[str]:
    """The modules of ``names`` that cannot be found (without importing them)."""
    return [m for m in names if importlib.util.find_spec(m) is None]


NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # where NIXL may be installed (kvgeom_nixl.agent.NIXL_PACKAGES)
TRANSFER_ENTRY_POINTS = "kvgeom.transfer"
"""Entry point group an executor registers its ``transfer_report`` function under (``kvgeom_nixl``: ``nixl``)."""


def _executor() -> Callable[..., dict[str, Any]]:
    """The registered executor's ``transfer_report`` (kvgeom never imports its executor)."""
    missing = _missing_modules(("torch",))
    if len(_missing_modules(NIXL_MODULES)) == len(NIXL_MODULES):  # the meta package or one CUDA flavour
        missing.append("nixl")
    if missing:
        raise _Unavailable("transfer", f"needs {' and '.join(missing)}, not installed", fix=NIXL_HINT)
    found = sorted(entry_points(group=TRANSFER_ENTRY_POINTS), key=lambda ep: ep.name)
    if not found:
        raise _Unavailable("transfer", f"no executor is registered under the entry point group "
                           f"{TRANSFER_ENTRY_POINTS!r}", fix=f"install kvgeom with its executor: {NIXL_HINT}")
    run: Callable[..., dict[str, Any]] = found[0].load()
    return run


def _run_transfer(args: argparse.Namespace) -> int:
    timeout_s = check_seconds("--timeout", args.timeout, error=KvGeomError)
    preset, tokens, prefix = resolve_preset(args)
    budget = budget_of(args)
    prefill, decode = preset.geometries(tokens, prefix, layers=args.layers)
    if pairable(prefill, decode):  # the executor reports an unpairable preset itself
        pair = Pair(prefill, decode)
        rings = 0
        if args.strategy in ("packed", "auto") and args.staging_bytes > 0:
            # a ring of 2 slots per rank, each the busiest chunk: at most the slot and every byte D receives
            rings = 2 * min(args.staging_bytes, engine_bytes(decode)) * (prefill.num_ranks + decode.num_ranks)
        check_memory("caches, staging rings and check", engine_bytes(prefill) + 2 * engine_bytes(decode) + rings,
                      budget, "transfer fewer --tokens or --layers" + (", or pass a smaller --staging-bytes"
                                                                          if rings else ""))
        check_simulation(pair, budget, "transfer fewer --tokens or --layers")
        shape = fresh_shape(pair, tokens, decode_tokens=preset.decode_tokens(tokens), prefix_hit_tokens=prefix)
        check_budget(pair, shape, args.strategy, staging_bytes=args.staging_bytes, budget=budget)
    transfer_report = _executor()
    report = transfer_report(preset.name, tokens, prefix, layers=args.layers, push=args.push, mode=args.mode,
                             strategy=args.strategy, timeout_s=timeout_s, staging_bytes=args.staging_bytes,
                             budget=budget)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_transfer(report)
    return 0 if report["verified"] else 1


def _print_transfer(r: dict[str, Any]) -> None:
    """The human summary of one ``transfer_report``."""
    print(f"kvgeom transfer: {r['preset']}, M={r['tokens']} S={r['prefix']}, {r['direction']}, mode {r['mode']}, "
          f"strategy {r['strategy']}")
    print(f"  P  {r['prefill']}")
    print(f"  D  {r['decode']}")
    rows = (f"{r['wire_descriptors']:,} wire rows in {r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}"
            if r["packed"] else f"{r['copies']:,} copies")
    print(f"  plan: {rows} / {format_bytes(r['bytes'])}, {r['zeros']:,} zero rows / "
          f"{format_bytes(r['zero_bytes'])}, {r['rearranges']} rearranges")
    merged = "" if r["nixl_descs"] is None else f" ({r['nixl_descs']:,} after NIXL's merge)"
    rate = r["bytes_moved"] / r["transfer_s"] / 1e9 if r["transfer_s"] > 0 else 0.0
    print(f"  NIXL: {r['agents']} agents (connect {r['connect_s'] * 1e3:.1f} ms), {r['nixl_requests']} requests, "
          f"{r['descriptors_posted']:,} descriptors posted{merged}")
    if r["packed"]:
        print(f"  packed: {r['packs']} pack and {r['unpacks']} unpack steps, ring slots of "
              f"{format_bytes(r['staging_slot_bytes'])}; pack {r['pack_s'] * 1e3:.2f} ms, wire "
              f"{r['wire_s'] * 1e3:.2f} ms, unpack {r['unpack_s'] * 1e3:.2f} ms (summed over ranks)")
    print(f"  moved {format_bytes(r['bytes_moved'])} in {r['transfer_s'] * 1e3:.2f} ms ({rate:.2f} GB/s, "
          f"incl. first-contact wire-up and receive steps); zeroed {format_bytes(r['bytes_zeroed'])}, "
          f"{r['rearranges_applied']} rearranges")
    if r["failure"]:
        f = r["failure"]
        print(f"  transfer FAILED: {f['reason']}: {f['detail']}")
        print(f"  invalid D blocks: {f['invalid_blocks']}")
    print(f"  verify: {r['checked_bytes']:,} D bytes checked with the simulator, {len(r['violations'])} violation runs")
    for v in r["violations"][:10]:
        print(f"    - {v}")
    print(f"  wall time {r['wall_s']:.2f} s (setup {r['setup_s']:.2f}, verify {r['verify_s']:.2f})")
    print(f"verdict: {'OK' if r['verified'] else 'FAILED'}")


# ---- kvgeom fuzz ----------------------------------------------------------------------------------------

def _fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=1000, metavar="N",
                        help="hypothesis examples to run (default 1000; 100000 takes under an hour on 2 cores)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="random seed (default: a fresh one, printed so the run can be repeated)")
    parser.add_argument("--strategy", choices=(*STRATEGIES, "all"), default="all",
                        help="planner strategy to check on every example (default all four)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="M",
                        help="longest request drawn, in computed tokens (default 64)")
    parser.add_argument("--mismatch-probability", type=float, default=0.1, metavar="P",
                        help="share of pairs whose decode model differs (must be rejected; default 0.1)")
    parser.add_argument("--topology-probability", type=float, default=0.3, metavar="P",
                        help="share of engines drawn with pipeline stages, DCP or replicas (default 0.3)")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="also write each failure's pair file to FILE (FILE-2, FILE-3... for more)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    budget_arguments(parser)


def _run_fuzz(args: argparse.Namespace) -> int:
    if _missing_modules(("hypothesis",)):
        raise _Unavailable("fuzz", "needs hypothesis, not installed", fix=install_hint("testing"))
    from .fuzz import run_fuzz  # hypothesis is imported only when fuzz runs

    return run_fuzz(args)


# ---- registry and main ---------------------------------------------------------------------------------

COMMANDS: dict[str, Command] = {
    "plan": Command("plan a preset's (or a pair file's) transfer and verify it with the simulator",
                    _plan_arguments, _run_plan),
    "presets": Command("list the named P/D pairs", _presets_arguments, _run_presets),
    "transfer": Command("run a preset's transfer with real NIXL agents on this machine and verify every D byte",
                        _transfer_arguments, _run_transfer),
    "fuzz": Command("fuzz the planner against the simulator with hypothesis", _fuzz_arguments, _run_fuzz),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option)."""
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def _version() -> str:
    try:
        return version("kvgeom")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (declaring arguments never imports an optional extra)."""
    parser = argparse.ArgumentParser(
        prog="kvgeom",
        description="Plan and check KV-cache transfers between prefill and decode engines whose cache "
                    "geometries differ.",
        epilog="exit status: 0 ok; 1 verification failed or internal error; 2 bad input, unpairable engines "
               "or a missing optional extra",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of internal errors")
    parser.add_argument("--version", action="version", version=f"kvgeom {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of internal errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, parents=[common])
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (``python -m kvgeom`` and ``kvgeom`` exit with it)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    chosen = _chosen(args_list)
    as_json = "--json" in args_list
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(args_list)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
            return e.code if isinstance(e.code, int) else 2
        run = getattr(args, "_run", None)
        if run is None:
            parser.print_help()
            return 2
        return int(run(args))
    except KvGeomError as e:
        print(f"kvgeom {chosen or ''}: error: {e}".replace("  ", " "), file=sys.stderr)
        if as_json:
            _json_out({"error": _reason_dict(e), "pairable": False if isinstance(e, IncompatibleGeometry) else None,
                       "verified": False, "violations": []})
        return 2
    except KeyboardInterrupt:
        print("kvgeom: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`kvgeom presets | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as e:  # noqa: BLE001 - the CLI's last line of defence: one line first, always
        print(f"kvgeom {chosen or ''}: internal error: {type(e).__name__}: {e}"
              + ("" if debug else " (run with --debug for the traceback)"), file=sys.stderr)
        if debug:
            traceback.print_exc()
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
