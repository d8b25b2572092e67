"""The reference simulator's whole run: apply a transfer plan to numpy byte buffers and check every
invariant of docs/design.md §4.2 (the simulator itself is docs/design.md §7).

This is the project's oracle. It is written from the model only -- the geometry's
``attention_address`` / ``state_address``, TP ownership (``owned_slice``) and the request's block
lists -- and never from the planner. :func:`simulate` strings the package's modules together::

    walk.check_request          the request fits the pair; no two groups list one page
    plan_checks                 rows alone: OUT_OF_BOUNDS, FOREIGN_*, OVERLAPPING_WRITE, NOT_MINIMAL,
                                NONDETERMINISTIC (with replan); out-of-bounds rows are set aside
    memory + fill               P: coordinate hash on computed coordinates, garbage elsewhere
                                D: stale pattern, the coordinate hash on the prefix D holds
    apply                       copies, then rearranges, then packed chunks (packs, wire rows,
                                unpacks; kvgeom.checking.staging), then zeros (the rows in bounds)
    content                     every D byte against the expected bytes: MISSING, NOT_ZEROED,
                                WRONG_DATA, CLOBBERED
    report                      counts exact, at most LIST_LIMIT violations listed per kind

    P memory --copies--> D memory --rearranges--> --zeros--> compare with expected D, byte by byte

Module map (each imports only modules listed above it)::

    hashing      coordinate hash, background patterns            (no module of the package)
    memory       Memory: allocate / wrap / copy                  (none)
    report       ViolationKind, Violation, Report, the sink      (none)
    walk         listed / writable pages, vectors and units      memory
    describe     a byte's coordinate in words                    walk
    fill         fill_prefill, fill_decode                       hashing, memory, walk
    bounds       out-of-bounds rows                              report
    apply        apply_plan                                      memory, report, bounds
    plan_checks  check_plan                                      report, walk, describe, bounds
    content      expected D bytes, check_decode                  hashing, memory, report, walk, describe, fill
    simulator    simulate                                        memory, report, walk, fill, apply, plan_checks, content

Worked number: P engine TP1, HND, 2 local heads of 256 B, K = 16, K/V packed (the geometry
module's example). Head 1, V plane, token 5 of kernel page 0 starts at byte
``8192 + 4096 + 5 * 256 = 13568``; P's bytes [13568, 13824) hold
``coordinate_hash(g, layer, token=5, plane=1, head=1, nbytes=256)``, and a D rank holding head 1
must end with the same 256 bytes at its own address of (layer, token 5, V, head 1).
"""

from __future__ import annotations

import attrs

from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Rearrange, TransferPlan
from ..values.request import Request
from .apply import apply_plan
from .content import content_checks
from .fill import fill_decode, fill_prefill
from .memory import Memory
from .plan_checks import run_plan_checks
from .report import LIST_LIMIT, Report, Sink
from .walk import check_request

__all__ = ["simulate"]


def simulate(pair: CheckedEngines, request: Request, plan: TransferPlan, *, replan: TransferPlan | None = None) -> Report:
    """Check ``plan`` against every invariant of docs/design.md §4.2 and return a :class:`Report`.

    Allocates both engines' memory, fills it, runs the plan-level checks, applies the plan
    (without OUT_OF_BOUNDS rows, which are reported instead, with a ``ROWS_NOT_APPLIED`` note)
    and compares every D byte.
    """
    check_request(pair, request)
    Memory.check_size(pair.prefill)  # before any per-rank work: a hostile rank count is refused in O(regions)
    Memory.check_size(pair.decode)
    sink = Sink(LIST_LIMIT)
    copy_bad, zero_bad, rearr_bad, packed_masks = run_plan_checks(pair, request, plan, replan, sink)
    skipped = int(copy_bad.sum() + zero_bad.sum() + rearr_bad.sum() + sum(int(m.sum()) for m in packed_masks))
    if skipped:
        sink.notes.append(Note(NoteKind.ROWS_NOT_APPLIED, f"{skipped} out-of-bounds rows were not applied"))
        kept: tuple[Rearrange, ...] = tuple(r for k, r in enumerate(plan.rearranges) if not rearr_bad[k])
        plan = attrs.evolve(plan, prefill_tp=pair.prefill.tp, decode_tp=pair.decode.tp,
                            prefill_ranks=pair.prefill.num_ranks, decode_ranks=pair.decode.num_ranks,
                            copies=plan.copies.take(~copy_bad), zeros=plan.zeros.take(~zero_bad),
                            rearranges=kept)  # type: ignore[arg-type]  # plan.py: converter=tuple is untyped
    pmem, dmem = Memory.allocate(pair.prefill), Memory.allocate(pair.decode)
    fill_prefill(pair, request, pmem)
    fill_decode(pair, request, dmem)
    apply_plan(plan, pmem, dmem, packed_masks=packed_masks)
    checked = content_checks(pair, request, dmem, sink)
    return sink.report(checked)
