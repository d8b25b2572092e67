"""The planner: ``plan_transfer`` and :class:`Pair` (group planners, strategies, coalescing).

Pure addressing arithmetic: no torch, no NIXL, no device, no I/O.
"""

from __future__ import annotations

from .attention import (
    needed_tokens,
    plan_attention_group,
    zero_intervals,
)
from .choose import (
    DEFAULT_COST_MODEL,
    STRATEGIES,
    CostModel,
    Strategy,
    plan_group,
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
    plan_staged_group,
)
from .state import (
    paired_slots,
    plan_state_group,
)
from .transfer import (
    Pair,
    plan_pair,
    plan_reference,
    plan_transfer,
)

__all__ = [
    "needed_tokens",
    "zero_intervals",
    "plan_attention_group",
    "Strategy",
    "STRATEGIES",
    "CostModel",
    "DEFAULT_COST_MODEL",
    "plan_group",
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
    "plan_staged_group",
    "paired_slots",
    "plan_state_group",
    "Pair",
    "plan_transfer",
    "plan_pair",
    "plan_reference",
]
