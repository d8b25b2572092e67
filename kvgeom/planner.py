"""plan_transfer: two engine geometries and one request in, a :class:`TransferPlan` out.

Pure addressing arithmetic: no torch, no NIXL, no device, no I/O. Per group it dispatches on the
group's kind, then coalesces everything once::

    request --> attention groups (kvgeom.attention) --\\
            --> state groups     (kvgeom.state)     ----> coalesce --> TransferPlan(copies, zeros,
                                                                          rearranges, notes)

Worked number: P and D both TP1, HND, K=16, one layer of 8 heads x 256 B (64 KiB pages), 64
tokens on fresh blocks 0..3 on both sides: 4 pages x 1 plane-run each = 4 rows before
coalescing, 1 row of 4 * 65536 = 262144 B after.
"""

from __future__ import annotations

import functools
from typing import Literal

import attrs

from .attention import plan_attention_group
from .coalesce import coalesce, coalesce_zeros
from .errors import KvGeomError
from .geometry import EngineGeometry
from .model import AttentionSpec
from .pair import Pair
from .plan import Copies, Rearrange, TransferPlan, Zeros
from .request import Request
from .staged import plan_staged_group
from .state import plan_state_group

__all__ = ["plan_transfer", "plan_pair", "STRATEGIES", "CostModel"]

Strategy = Literal["direct", "staged", "auto"]
STRATEGIES: tuple[str, ...] = ("direct", "staged", "auto")


@attrs.frozen
class CostModel:
    """What ``strategy="auto"`` weighs, per attention group.

    ``direct = copies * descriptor_seconds`` against
    ``staged = copies * descriptor_seconds + rearranged_bytes / rearrange_bytes_per_second``,
    copies counted before coalescing. The defaults are ``python -m benchmarks`` measurements on
    the 2-core CPU machine this project tests on: NIXL/UCX posted descriptors at 1.38 to 2.1 us
    each (in-process, DRAM; reference/nixl-on-cpu.md saw 1.1 to 2.5 us), and the executor's torch
    rearrange moved CPU tensors at 0.6 to 3.2 GB/s across runs (the VM is noisy); 1.5 GB/s sits in
    between. On a GPU the rearrange is two orders of magnitude cheaper: pass your own numbers.
    """

    descriptor_seconds: float = 1.5e-6
    rearrange_bytes_per_second: float = 1.5e9

    def cost(self, copies: int, rearranged_bytes: int) -> float:
        return copies * self.descriptor_seconds + rearranged_bytes / self.rearrange_bytes_per_second


@functools.lru_cache(maxsize=64)
def _pair(prefill: EngineGeometry, decode: EngineGeometry) -> Pair:
    return Pair(prefill, decode)


def plan_transfer(
    prefill: EngineGeometry,
    decode: EngineGeometry,
    request: Request,
    *,
    strategy: Strategy = "direct",
    cost_model: CostModel = CostModel(),
) -> TransferPlan:
    """Plan ``request``'s transfer from ``prefill`` to ``decode``.

    The pair is checked once (and cached) before any request; raises
    :class:`~kvgeom.errors.IncompatibleGeometry` if the engines cannot be paired and
    :class:`~kvgeom.errors.RequestError` if the request does not fit them.
    """
    return plan_pair(_pair(prefill, decode), request, strategy=strategy, cost_model=cost_model)


def _choose(pair: Pair, request: Request, gi: int, strategy: str,
            cost_model: CostModel) -> tuple[Copies, Zeros, list[Rearrange], list[str], int]:
    """One attention group under ``strategy``. Auto compares row counts before coalescing, counted
    without building the rows, and builds only the winner."""
    if strategy == "direct":
        c, z, n, count = plan_attention_group(pair, request, gi)
        return c, z, [], n, count
    if strategy == "staged":
        return plan_staged_group(pair, request, gi)
    _, _, rearr, _, n_staged = plan_staged_group(pair, request, gi, materialize=False)
    if not rearr:  # staged does not apply or equals direct
        c, z, n, count = plan_attention_group(pair, request, gi)
        return c, z, [], n, count
    _, _, _, n_direct = plan_attention_group(pair, request, gi, materialize=False)
    moved = sum(r.nbytes_per_page * len(r.pages) for r in rearr)
    cost_d, cost_s = cost_model.cost(n_direct, 0), cost_model.cost(n_staged, moved)
    name = pair.model.groups[gi].name
    why = (f"{name}: auto: direct {n_direct} copies = {cost_d * 1e6:.1f} us; staged {n_staged} copies + "
           f"{moved} B rearranged = {cost_s * 1e6:.1f} us "
           f"({cost_model.descriptor_seconds * 1e6:g} us/descriptor, {cost_model.rearrange_bytes_per_second:.3g} B/s; "
           "copies counted before coalescing)")
    if cost_s < cost_d:
        c, z, r, n, count = plan_staged_group(pair, request, gi)
        return c, z, r, n + [why + " -> staged"], count
    c, z, n, count = plan_attention_group(pair, request, gi)
    return c, z, [], n + [why + " -> direct"], count


def plan_pair(pair: Pair, request: Request, *, strategy: Strategy = "direct",
              cost_model: CostModel = CostModel()) -> TransferPlan:
    """:func:`plan_transfer` for an already built :class:`Pair`."""
    if strategy not in STRATEGIES:
        raise KvGeomError("strategy", f"unknown strategy {strategy!r}", actual=strategy,
                          expected=list(STRATEGIES), fix=f"use one of {', '.join(STRATEGIES)}")
    pair.check_request(request)
    copies: list[Copies] = []
    zeros: list[Zeros] = []
    rearranges: list[Rearrange] = []
    notes: list[str] = [f"strategy {strategy}"]
    before = 0
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, AttentionSpec):
            c, z, r, n, count = _choose(pair, request, gi, strategy, cost_model)
            zeros.append(z)
            rearranges.extend(r)
        else:
            c, n = plan_state_group(pair, request, gi)
            count = len(c)
        copies.append(c)
        notes.extend(n)
        before += count
    raw_c = copies[0] if len(copies) == 1 else Copies.concat(copies)
    raw_z = zeros[0] if len(zeros) == 1 else Zeros.concat(zeros)
    return TransferPlan(
        prefill_tp=pair.prefill.tp,
        decode_tp=pair.decode.tp,
        copies=coalesce(raw_c),
        zeros=coalesce_zeros(raw_z),
        rearranges=rearranges,
        notes=tuple(notes),
        copies_before_coalescing=before,
        zeros_before_coalescing=len(raw_z),
    )
