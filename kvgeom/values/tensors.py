"""An engine's geometry read from its cache tensors: shapes, strides, item sizes and addresses (docs/design.md §10.1).

A connector holds the tensors its attention backend allocated. Describing them by hand (byte
strides, region lists) is where layout bugs come from, so :meth:`EngineGeometry.from_tensors`
reads them: per layer, the tensor(s) and an einops-style description of their axes::

    "kv page token head dim"      FlashAttention (2, blocks, tokens, heads, dim); strides say NHD or HND
    "page kv token head dim"      FlashInfer / TRT-LLM (blocks, 2, tokens, heads, dim), one tensor per layer
    "page token head dim"         K and V as two tensors (tensors=(k, v)), e.g. SGLang-like pools
    "(page token) head dim"       a token pool cut into pages (give sizes={"token": K})
    "page layer kv head token dim" TensorRT-LLM-like pools: every layer of the group inside each block
    "page token dim"              MLA: one latent per token, no head and no K/V axis
    {"x B C": "page channel row", "ssm": "page channel hd ds"}   mamba state tensors per section

Axis names: ``page`` (or ``block``), ``token``, ``head``, ``kv``, ``layer``, ``channel``, ``row``;
every other name is part of the element (head vector or state unit; none: one item) and those
axes must be innermost and contiguous. Only byte arithmetic is used: ``shape``, ``stride()`` / ``strides``,
the item size and ``data_ptr()`` / ``__array_interface__`` (torch and numpy, duck-typed; kvgeom
never imports torch)::

    tensor --parse axes--> sizes and byte strides per name --> per layer and plane: address, page stride
      --regions--> registered buffers (regions=...) or the allocations the views share
                   (views of one allocation whose bytes overlap form one region)
      --> Region(num_pages, page_bytes), PageLayout(kv, head, token strides), views (region, offset)

Every fact is hostile input (docs/design.md §14): :class:`TensorFacts` and :class:`LayerTensors`
check their fields when built (dimensions and byte strides within ``MAX_INT``, an address in
``[0, 2**64)``), the element's bytes are a :func:`~kvgeom.arith.checked_product` (an int64 product
of the element axes wrapped a 2**64 + 128 B element to 128 B), and a wrong argument is a
``GeometryError`` naming it.

Worked number: FlashAttention HND, 8 heads of 128 bf16 (256 B), 16-token pages, 64 blocks:
shape (2, 64, 16, 8, 128) with element strides (131072, 2048, 128, 2048, 1): the kv axis
(262144 B) lies beyond the 64 pages of 4096 B, so K and V are two regions of 64 x 32768 B with
``head_stride = 2048 * 2 = 4096`` and ``token_stride = 128 * 2 = 256``.

This module reads the whole geometry (:func:`tensor_fields`); one tensor's facts are
:mod:`kvgeom.values.strided`, the axis descriptions :mod:`kvgeom.values.axes`, one group's layers
:mod:`kvgeom.values.tensor_groups`, the regions :mod:`kvgeom.values.tensor_regions`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import GeometryError
from .axes import AXIS_NAMES, LayerTensors, parse_axes
from .engine_checks import MAX_REGIONS
from .fields import as_tuple, check_instance, check_int, check_str
from .layout import GroupGeometry, StateLayout
from .model import AttentionSpec, ModelSpec
from .strided import ADDRESS_LIMIT as ADDRESS_LIMIT
from .strided import MAX_DIMS as MAX_DIMS
from .strided import TensorFacts, tensor_facts
from .strided import check_address as check_address
from .tensor_groups import MAX_SIZES as MAX_SIZES
from .tensor_groups import (
    _attention_geometry,
    _attention_group,
    _AttnLayer,
    _check_layer_overlap,
    _kernel_tokens,
    _sizes,
    _state_geometry,
    _state_group,
    _StateLayer,
)
from .tensor_regions import _Candidate, _regions

__all__ = ["LayerTensors", "TensorFacts", "tensor_facts", "parse_axes", "tensor_fields", "AXIS_NAMES"]


def tensor_fields(
    model: ModelSpec,
    *,
    tp: int,
    layers: Sequence[LayerTensors],
    kernel_block_tokens: int | None = None,
    blocks_per_logical: int | None = None,
    regions: Sequence[Any] | None = None,
    sizes: Mapping[str, int] | None = None,
    state_layout: StateLayout | str | None = None,
    name: str = "engine",
) -> dict[str, Any]:
    """The keyword arguments of ``EngineGeometry(...)`` read from cache tensors (see the module).

    ``layers``: :class:`LayerTensors`, one per layer of every group, each group's layers in order
    (a group given with a ``layer`` axis has one entry). ``regions``: the buffers the executor
    registers, in order (tensors, arrays or ``(address, nbytes)``); without them every set of
    views whose bytes overlap in one allocation is one region, in order of first use.
    ``kernel_block_tokens`` and ``blocks_per_logical`` default to what the tensors show (ppl: the
    state page over the attention page where they share a region, else 1). ``state_layout``
    breaks the tie when both layouts place a group's sections identically.
    """
    name = check_str("name", name)
    check_instance(f"{name}.model", model, ModelSpec)
    tp = check_int(f"{name}.tp", tp, minimum=1)
    sizes = _sizes(sizes, f"{name}.sizes")
    if kernel_block_tokens is not None:
        kernel_block_tokens = check_int(f"{name}.kernel_block_tokens", kernel_block_tokens, minimum=1)
        sizes.setdefault("token", kernel_block_tokens)
    if regions is not None:
        regions = as_tuple(regions, f"{name}.regions", max_len=MAX_REGIONS)
    # a group given with a layer axis has one entry, so no model has more entries than layers
    given = as_tuple(layers, f"{name}.layers", max_len=sum(g.num_layers for g in model.groups))
    by_group: dict[str, list[LayerTensors]] = {g.name: [] for g in model.groups}
    for i, entry in enumerate(given):
        if not isinstance(entry, LayerTensors):
            raise GeometryError(f"{name}.layers[{i}]", f"expected LayerTensors, got {type(entry).__name__}",
                                actual=type(entry).__name__, fix="wrap each layer as LayerTensors(group, axes, tensors)")
        if entry.group not in by_group:
            raise GeometryError(f"{name}.layers[{i}].group", f"no group named {entry.group!r}", actual=entry.group,
                                expected=list(by_group), fix="use the model's group names")
        by_group[entry.group].append(entry)

    cands: list[_Candidate] = []
    attn: dict[int, list[_AttnLayer]] = {}
    states: dict[int, list[_StateLayer]] = {}
    for gi, spec in enumerate(model.groups):
        entries = by_group[spec.name]
        if isinstance(spec, AttentionSpec):
            attn[gi] = _attention_group(gi, spec, entries, tp, sizes, cands, name)
        else:
            states[gi] = _state_group(gi, spec, entries, tp, sizes, cands, name)

    K = _kernel_tokens(attn, kernel_block_tokens, name)
    region_list, placed, ppl = _regions(cands, regions, blocks_per_logical, name)
    groups: list[GroupGeometry] = []
    for gi, spec in enumerate(model.groups):
        if isinstance(spec, AttentionSpec):
            groups.append(_attention_geometry(gi, spec, attn[gi], placed, K, name))
        else:
            groups.append(_state_geometry(spec, states[gi], placed, tp, state_layout, name))
    _check_layer_overlap(model, tp, K, groups, attn, states, name)
    return dict(model=model, tp=tp, kernel_block_tokens=K, blocks_per_logical=ppl, regions=tuple(region_list),
                groups=tuple(groups), name=name)
