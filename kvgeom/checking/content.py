"""Content checks: every D byte after the plan ran, against what a correct transfer leaves there.

The expected D memory is :func:`~kvgeom.checking.fill.fill_decode`'s bytes with each byte given a
category (per group ``g``; ``[p0, p1)`` and ``[d0, d1)`` are the token ranges of the listed P and D
blocks, ``M`` computed tokens, ``S`` prefix-hit tokens; docs/design.md §3.4)::

    D tokens   d0 ........ S ........ lo ============ hi ........ d1
               |   keep    | must be  |    needed     | must be  |
               | (D holds) |  zero    | (P's hash)    |  zero    |

* **needed** (attention, D rank ``d``): tokens ``[lo, hi)``, ``lo = max(S, d0, p0, ws)``,
  ``hi = min(M, d1, p1)``, every layer, plane, byte and every head D rank ``d`` holds: the
  coordinate hash P computed (docs/design.md §4.2, invariant 3). ``ws`` is 0, or for a sliding
  group of window ``W`` the first token the next query attends to, ``max(0, M - W + 1)`` (the
  model's window and vLLM's convention, :func:`kvgeom.arith.tokens.window_start`): tokens before
  it are never read again.
  (state) a D slot is *paired* with the P slot that lists the same ``tokens``; every coordinate of
  D rank ``d``'s section slices of a paired slot is needed.
* **must be zero** (attention only): tokens ``[max(S, d0), d1)`` outside ``[lo, hi)``, all of D's
  heads, planes and layers (head-vector bytes only, not padding): docs/design.md §4.2 (invariant 4).
* **keep**: everything else in D (the prefix ``[d0, S)``, padding, other blocks, unpaired state
  slots) must keep the value ``fill_decode`` gave it (docs/design.md §4.2, invariant 4).

A difference is reported per run of bad bytes of one category; bad bytes at most ``_GAP`` bytes apart
join one run, since a wrong byte equals the right one with probability 1/256. A run of needed
bytes that all still hold D's stale pattern is MISSING, of must-be-zero bytes NOT_ZEROED, any other
bad needed or must-be-zero run WRONG_DATA, and a bad keep run CLOBBERED. A run also ends where the
bad bytes change from stale to written (or back), so a stale tail next to wrongly written bytes is
reported as what it is; a stale stretch spanning fewer than ``_MIN_STALE`` bytes inside written
bytes is a coincidence (each byte matches the pattern with probability 1/256) and stays written.

Worked number: d0 = 0, d1 = 64, S = 16, p0 = 0, p1 = 48, M = 40: lo = max(16, 0, 0) = 16,
hi = min(40, 64, 48) = 40, so D tokens [0, 16) keep, [16, 40) are needed and [40, 64) must be zero.

On a topology each D rank's categories cover only what it holds (docs/design.md §11.5): the layers
of its stage, its head group's heads and its DCP rank's tokens; every byte of the regions of its
stage is compared.
"""

from __future__ import annotations

import numpy as np

from ..arith.tokens import window_start
from ..values.model import AttentionSpec
from ..values.pair import CheckedEngines
from ..values.request import Request
from .describe import describe
from .fill import fill_decode
from .hashing import SALT_DECODE, attention_hash, pattern_bytes, state_hash
from .memory import Memory, check_memory
from .report import Sink, Violation, ViolationKind
from .walk import attention_vectors, check_request, listing, state_units, vector_index

__all__ = ["check_decode"]

_KEEP, _NEEDED, _ZERO = 0, 1, 2
_GAP = 4  # bad bytes at most this far apart form one run
_MIN_STALE = 8  # a stale stretch shorter than this inside written bytes is a coincidence


def _expected_decode(pair: CheckedEngines, request: Request) -> tuple[Memory, list[list[np.ndarray]]]:
    """D's bytes after a correct transfer, and each byte's category (keep, needed, must be zero)."""
    P, D = pair.prefill, pair.decode
    exp = Memory.allocate(D)
    fill_decode(pair, request, exp)
    cat = [[np.zeros(b.size, np.uint8) for b in regs] for regs in exp.buffers]
    M, S = request.computed_tokens, request.prefix_hit_tokens
    for g, spec in enumerate(D.model.groups):
        pl, dl = listing(request, g, "prefill"), listing(request, g, "decode")
        for rank in range(D.num_ranks):
            if isinstance(spec, AttentionSpec):
                p0, p1 = pl.token_range(P.logical_block_tokens)
                d0, d1 = dl.token_range(D.logical_block_tokens)
                start = max(S, d0)
                lo, hi = max(start, p0, window_start(M, spec.window_tokens)), min(M, d1, p1)
                spans = [(lo, hi, _NEEDED)] if lo < hi else []
                spans += [(start, min(lo, d1), _ZERO), (max(hi, start), d1, _ZERO)] if lo < hi else [(start, d1, _ZERO)]
                for a, b, what in spans:
                    for layer, plane, region, starts, tokens, heads in attention_vectors(D, g, rank, dl, a, b):
                        idx = vector_index(starts, spec.head_bytes)
                        cat[rank][region][idx] = what
                        exp.buffers[rank][region][idx] = 0 if what == _ZERO else attention_hash(
                            g, layer, plane, tokens[:, None], heads[None, :], spec.head_bytes)
            else:
                p_tokens = set(pl.tokens)
                for slot_id, t in zip(dl.slot_ids, dl.tokens, strict=True):
                    if t not in p_tokens:
                        continue  # unpaired: D keeps whatever it had
                    for layer, si, region, starts, chans, rows, unit in state_units(D, g, rank, slot_id):
                        idx = vector_index(starts, unit)
                        cat[rank][region][idx] = _NEEDED
                        exp.buffers[rank][region][idx] = state_hash(g, layer, si, t, chans[:, None], rows[None, :],
                                                                    unit)
    return exp, cat


def _stale_stretches(at: np.ndarray, stale: np.ndarray) -> np.ndarray:
    """``stale`` with every stale stretch (consecutive bad bytes that match the pattern) spanning fewer
    than ``_MIN_STALE`` bytes turned written, when written bad bytes lie on either side of it."""
    if not stale.size or stale.all() or not stale.any():
        return stale
    change = np.concatenate(([True], stale[1:] != stale[:-1]))
    first = np.flatnonzero(change)
    last = np.append(first[1:], stale.size) - 1
    short = stale[first] & (at[last] - at[first] + 1 < _MIN_STALE) & ((first > 0) | (last < stale.size - 1))
    if not short.any():
        return stale
    out = stale.copy()
    for a, b in zip(first[short].tolist(), last[short].tolist()):
        out[a:b + 1] = False
    return out


def content_checks(pair: CheckedEngines, request: Request, dmem: Memory, sink: Sink) -> int:
    """Compare every byte of ``dmem`` with the expected D memory into ``sink`` (package-internal);
    returns the number of D bytes compared."""
    D = pair.decode
    check_memory(dmem, D, "decode")
    exp, cat = _expected_decode(pair, request)
    checked = 0
    for rank in range(D.num_ranks):
        for region in D.rank_regions(rank):
            got, want = dmem.buffers[rank][region], exp.buffers[rank][region]
            checked += got.size
            at = np.flatnonzero(got != want)
            if not at.size:
                continue
            category = cat[rank][region][at]
            stale = _stale_stretches(at, got[at] == pattern_bytes(SALT_DECODE, rank, region, at))
            # runs: bad bytes of one category at most _GAP apart (a wrong byte equals the expected one
            # by chance with probability 1/256; bridging such holes keeps one run per damaged range),
            # cut where stale bytes give way to written ones
            new = np.concatenate(([True], (np.diff(at) > _GAP) | (category[1:] != category[:-1])
                                  | (stale[1:] != stale[:-1])))
            first = np.flatnonzero(new)
            last = np.append(first[1:], at.size) - 1
            span = at[last] - at[first] + 1
            bad = last - first + 1
            all_stale = np.minimum.reduceat(stale.astype(np.uint8), first).astype(bool)
            run_cat = category[first]
            codes = np.where(run_cat == _KEEP, 0, np.where(all_stale, np.where(run_cat == _NEEDED, 1, 2), 3))
            for code, kind in enumerate((ViolationKind.CLOBBERED, ViolationKind.MISSING, ViolationKind.NOT_ZEROED,
                                         ViolationKind.WRONG_DATA)):
                runs = np.flatnonzero(codes == code)

                def make(i: int, runs: np.ndarray = runs, kind: ViolationKind = kind, rank: int = rank,
                         region: int = region, got: np.ndarray = got, want: np.ndarray = want,
                         at: np.ndarray = at, first: np.ndarray = first, span: np.ndarray = span) -> Violation:
                    r = int(runs[i])
                    off, n = int(at[first[r]]), int(span[r])
                    show = min(n, 8)
                    more = "..." if n > show else ""
                    return Violation(kind, "decode", rank, region, off, n,
                                     describe(D, request, "decode", rank, region, off),
                                     f"expected {want[off:off + show].tobytes().hex()}{more} "
                                     f"got {got[off:off + show].tobytes().hex()}{more}")

                sink.add(kind, len(runs), int(bad[runs].sum()), make)
    return checked


def check_decode(pair: CheckedEngines, request: Request, dmem: Memory, *,
                 max_per_kind: int | None = None) -> tuple[list[Violation], int]:
    """Content invariants on D memory after a plan ran on :func:`fill_prefill` /
    :func:`fill_decode` memory. Every D byte is compared with the expected bytes; a difference is
    reported per run of consecutive bytes of one category:

    * needed bytes: MISSING when every byte of the run still holds the stale pattern, else WRONG_DATA;
    * must-be-zero bytes: NOT_ZEROED when the run is all stale, else WRONG_DATA;
    * every other byte: CLOBBERED.

    Returns the violations and the number of D bytes compared.
    """
    check_request(pair, request)
    sink = Sink(max_per_kind)
    checked = content_checks(pair, request, dmem, sink)
    return sink.items, checked
