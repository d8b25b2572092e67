"""Per group, which strategy builds its rows: direct, staged, or ``auto`` weighing the two by cost.

    attention group --strategy--> direct  (kvgeom.planning.attention)
                               -> staged  (kvgeom.planning.staged; falls back to direct, noted)
                               -> auto    count both without building rows, build the cheaper one
    state group     ----------->  direct  (kvgeom.planning.state; states are always copied in place)

The auto choice is recorded as an ``AUTO_DIRECT`` or ``AUTO_STAGED`` note with the numbers.

Worked number: 4096 direct copies cost ``4096 * 1.5 us = 6144 us``; staged with 512 copies and
64 MiB rearranged costs ``512 * 1.5 us + 67108864 B / 1.5 GB/s = 768 us + 44739 us``: auto picks direct.
"""

from __future__ import annotations

import logging
from typing import Literal

import attrs

from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.request import Request
from .attention import plan_attention_group
from .group import GroupPlan
from .staged import plan_staged_group
from .state import plan_state_group

__all__ = ["Strategy", "STRATEGIES", "CostModel", "DEFAULT_COST_MODEL", "plan_group"]

logger = logging.getLogger(__name__)

Strategy = Literal["direct", "staged", "auto"]
STRATEGIES: tuple[str, ...] = ("direct", "staged", "auto")


@attrs.frozen
class CostModel:
    """What ``strategy="auto"`` weighs, per attention group.

    ``direct = copies * descriptor_seconds`` against
    ``staged = copies * descriptor_seconds + rearranged_bytes / rearrange_bytes_per_second``,
    copies counted before coalescing. The defaults are ``python -m benchmarks`` measurements on
    the 2-core CPU machine this project tests on: NIXL/UCX posted descriptors at 1.38 to 2.1 us
    each (in-process, DRAM), and the executor's torch rearrange moved CPU tensors at 0.6 to 3.2 GB/s
    across runs (the VM is noisy); 1.5 GB/s sits in between. On a GPU the rearrange is two orders
    of magnitude cheaper: pass your own numbers.
    """

    descriptor_seconds: float = 1.5e-6
    rearrange_bytes_per_second: float = 1.5e9

    def cost(self, copies: int, rearranged_bytes: int) -> float:
        return copies * self.descriptor_seconds + rearranged_bytes / self.rearrange_bytes_per_second


DEFAULT_COST_MODEL = CostModel()


def _auto(pair: EnginePair, request: Request, gi: int, cost_model: CostModel) -> GroupPlan:
    """Count direct and staged rows without building them, then build only the cheaper plan."""
    staged_count = plan_staged_group(pair, request, gi, materialize=False)
    if not staged_count.rearranges:  # staged does not apply or equals direct
        logger.debug("%s: auto: staged does not apply or changes nothing -> direct", pair.model.groups[gi].name)
        return plan_attention_group(pair, request, gi)
    n_staged = staged_count.rows_before_coalescing
    n_direct = plan_attention_group(pair, request, gi, materialize=False).rows_before_coalescing
    moved = sum(r.nbytes_per_page * len(r.pages) for r in staged_count.rearranges)
    cost_d, cost_s = cost_model.cost(n_direct, 0), cost_model.cost(n_staged, moved)
    name = pair.model.groups[gi].name
    why = (f"{name}: auto: direct {n_direct} copies = {cost_d * 1e6:.1f} us; staged {n_staged} copies + "
           f"{moved} B rearranged = {cost_s * 1e6:.1f} us "
           f"({cost_model.descriptor_seconds * 1e6:g} us/descriptor, {cost_model.rearrange_bytes_per_second:.3g} B/s; "
           "copies counted before coalescing)")
    if cost_s < cost_d:
        logger.debug("%s -> staged", why)
        return plan_staged_group(pair, request, gi).with_notes(Note(NoteKind.AUTO_STAGED, why + " -> staged"))
    logger.debug("%s -> direct", why)
    return plan_attention_group(pair, request, gi).with_notes(Note(NoteKind.AUTO_DIRECT, why + " -> direct"))


def plan_group(pair: EnginePair, request: Request, gi: int, strategy: str, cost_model: CostModel) -> GroupPlan:
    """Group ``gi`` of ``request`` under ``strategy`` (state groups are always direct)."""
    if not isinstance(pair.model.groups[gi], AttentionSpec):
        return plan_state_group(pair, request, gi)
    if strategy == "direct":
        return plan_attention_group(pair, request, gi)
    if strategy == "staged":
        out = plan_staged_group(pair, request, gi)
        for n in out.notes:
            if n.kind is NoteKind.STAGED_NOT_APPLICABLE:
                logger.warning("staged asked for, direct planned instead: %s", n.text)
        return out
    return _auto(pair, request, gi, cost_model)
