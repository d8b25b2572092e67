"""Named geometries and requests, and ``verify`` (plan + simulate in one call).
"""

from __future__ import annotations

from .presets import (
    DEFAULT_PRESET,
    PRESETS,
    Preset,
    UnknownPreset,
    get_preset,
    hybrid_blocks_per_logical,
)
from .requests import (
    fresh_request,
    fresh_shape,
    fresh_span,
)
from .tables import (
    request_from_block_tables,
    state_slot_tokens,
)
from .verify import (
    verify,
)
from .vllm_config import (
    MAMBA_SECTIONS,
    VLLM_BACKENDS,
    VLLM_DTYPE_BYTES,
    VLLM_KV_CACHE_LAYOUTS,
    VLLM_LEGACY_BACKENDS,
    engine_from_vllm_config,
    vllm_region_layers,
)

__all__ = [
    "Preset",
    "PRESETS",
    "DEFAULT_PRESET",
    "UnknownPreset",
    "get_preset",
    "hybrid_blocks_per_logical",
    "fresh_request",
    "fresh_shape",
    "fresh_span",
    "request_from_block_tables",
    "state_slot_tokens",
    "verify",
    "engine_from_vllm_config",
    "VLLM_BACKENDS",
    "VLLM_DTYPE_BYTES",
    "MAMBA_SECTIONS",
    "VLLM_LEGACY_BACKENDS",
    "VLLM_KV_CACHE_LAYOUTS",
    "vllm_region_layers",
]
