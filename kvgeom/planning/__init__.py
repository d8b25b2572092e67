"""The planner: ``plan_transfer`` and :class:`Pair` (group planners, strategies, coalescing).

Pure addressing arithmetic: no torch, no NIXL, no device, no I/O.
"""

from __future__ import annotations

from .attention import (
    attention_zeros,
    needed_tokens,
    plan_attention_group,
    zero_intervals,
)
from .budget import (
    DEFAULT_BUDGET,
    PAGE_ENTRY_BYTES,
    ROW_BYTES,
    SEGMENT_BYTES,
    STEP_WORK,
    PlanBudget,
    PlanEstimate,
    estimate_compile,
    estimate_plan,
    quick_estimate,
)
from .choose import (
    DEFAULT_COST_MODEL,
    STRATEGIES,
    CostModel,
    GroupChoice,
    Posted,
    Strategy,
    choose_group,
    plan_group,
    posted,
)
from .coalesce import (
    coalesce,
    coalesce_zeros,
)
from .compiled import (
    CompiledGroup,
    CompiledPair,
    compile_pair,
)
from .group import (
    GroupPlan,
)
from .packed import (
    DEFAULT_STAGING_BYTES,
    PackedCount,
    PackedParts,
    count_packed,
    min_staging_bytes,
    plan_packed,
)
from .rows import (
    Rows,
)
from .sides import (
    SideView,
)
from .staged import (
    Arrival,
    ArrivedView,
    arrival,
    is_identity,
    plan_staged_group,
    rearrange_modes,
)
from .state import (
    paired_slots,
    plan_state_group,
    state_notes,
)
from .transfer import (
    Pair,
    check_budget,
    plan_pair,
    plan_reference,
    plan_transfer,
)

__all__ = [
    "PlanBudget",
    "PlanEstimate",
    "DEFAULT_BUDGET",
    "estimate_plan",
    "estimate_compile",
    "quick_estimate",
    "ROW_BYTES",
    "SEGMENT_BYTES",
    "PAGE_ENTRY_BYTES",
    "STEP_WORK",
    "needed_tokens",
    "zero_intervals",
    "plan_attention_group",
    "attention_zeros",
    "Strategy",
    "STRATEGIES",
    "CostModel",
    "DEFAULT_COST_MODEL",
    "plan_group",
    "Posted",
    "posted",
    "GroupChoice",
    "choose_group",
    "DEFAULT_STAGING_BYTES",
    "PackedCount",
    "PackedParts",
    "count_packed",
    "min_staging_bytes",
    "plan_packed",
    "coalesce",
    "coalesce_zeros",
    "CompiledGroup",
    "CompiledPair",
    "compile_pair",
    "GroupPlan",
    "Rows",
    "SideView",
    "Arrival",
    "ArrivedView",
    "arrival",
    "rearrange_modes",
    "is_identity",
    "plan_staged_group",
    "paired_slots",
    "plan_state_group",
    "state_notes",
    "Pair",
    "plan_transfer",
    "plan_pair",
    "check_budget",
    "plan_reference",
]
