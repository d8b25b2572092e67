"""One worker rank's geometry, read from the KV-cache tensors vLLM registers (docs/design.md §15.3).

The connector never computes a byte stride: it names the views vLLM's attention kernels read and
lets :meth:`kvgeom.EngineGeometry.from_tensors` read their shapes, strides and addresses
(docs/design.md §10.1). vLLM 0.32's CPU attention backend (``CPU_ATTN``, the ``vec``/``vec16``
kernels, float32 on x86) registers each layer as ``c = [blocks, heads, block_size, 2 * head_dim]``;
per (block, head) its bytes are K's ``block_size * head_dim`` elements, transposed (element ``d`` of
token ``s`` at ``d * block_size + s``), then V's in token order (docs/design.md §3.5). The two views::

    K = c.view(blocks, heads, 2, head_dim, block_size)[:, :, 0].transpose(-1, -2)
    V = c.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)[1]

both described as ``"page head token dim"``, read as a per-plane page layout whatever the block
size, so any block size on either side and token-exact sliding windows plan byte-exactly.

A mamba hybrid's state layers (vLLM's ``MambaSpec`` groups: mamba2, GDN) are registered as raw
pages ``[blocks, 1, 1, page_bytes]`` (int8); each block holds the layer's state tensors one after
the other, each ``shape`` of its ``dtype`` (vLLM's ``MambaBase.bind_kv_cache`` unpacks them the same
way). :func:`mamba_state_views` cuts them out, and they are described per section: the conv state
``"page channel row"`` (``VLLM_SSM_CONV_STATE_LAYOUT=DS``, ``(dim, kernel - 1)``) or ``"page row
channel"`` (``SD``), holding the conv sections side by side along the channels (mamba2: ``x B C``),
then the temporal state ``"page channel hd ds"`` (one unit per head). The sections themselves
(names, channels, TP sharding) are kvgeom's reading of vLLM's ``MambaSpec``
(:func:`kvgeom.building.engine_from_vllm_config`), passed in as ``model``.

What vLLM knows and the tensors do not (the groups, their logical block size, their window, the
model's total KV heads, each layer's backend and kernel, a state group's tensors) arrives as
:class:`CacheGroup` values, so this module imports neither vLLM nor torch (the tensors and dtypes
are duck-typed) and is tested without vLLM.
A backend or kernel whose page is not described here is refused by name
(:class:`~kvgeom_nixl.errors.ExecutorError`), never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgeom import AttentionSpec, EngineGeometry, LayerTensors, ModelSpec, StateSpec
from kvgeom_nixl.errors import ExecutorError

__all__ = ["CacheGroup", "CPU_ATTN", "CPU_ATTN_ISAS", "CPU_ATTN_AXES", "CPU_MLA_BACKENDS", "cpu_attn_views", "mamba_state_views", "geometry_from_kv_caches"]

CPU_ATTN = "CPU_ATTN"
CPU_ATTN_AXES = {"vec": "page head token dim", "vec16": "page head token dim", "amx": "page head token1 d1 token0 d0"}
"""How :func:`cpu_attn_views`'s K and V views of each kernel are described to ``from_tensors``."""
CPU_MLA_BACKENDS = ("CPU_MLA",)
"""The MLA backends whose cache is one latent row per token, ``[blocks, 1, block_size, latent]``
(float32: ``AMX_MLA`` runs bfloat16 only, and is not run here)."""
CPU_ATTN_ISAS = ("vec", "vec16", "amx")
"""The CPU_ATTN kernels read here: ``vec`` / ``vec16`` store K as ``[head_dim][block_size]``, ``amx``
(bfloat16) K in 16-token tiles of element pairs and V in token pairs (docs/design.md §3.5), read
as token axes in parts (§10.1, :func:`cpu_attn_views`)."""


@dataclass(frozen=True)
class CacheGroup:
    """One vLLM KV-cache group as the worker sees it (``kv_cache_config.kv_cache_groups[i]``).

    ``kind`` is ``"full"`` or ``"sliding"`` (``window`` tokens) or ``"mamba"`` (a state group);
    ``block_size`` is the group's logical block (``kv_cache_spec.block_size``); ``total_kv_heads``
    the model's KV heads before TP; ``backend`` and ``isa`` are each layer's attention backend name
    and kernel (``layer.isa``). A mamba group also has its state tensors per block
    (``state_shapes``, ``state_dtypes``: vLLM's ``MambaSpec.shapes`` and ``dtypes``), its conv
    state layout (``"DS"`` or ``"SD"``) and ``one_state`` (``mamba_cache_mode == "none"``: one
    running state per request, whatever the group's block size).
    """

    name: str
    kind: str
    layers: tuple[str, ...]
    block_size: int
    total_kv_heads: int
    window: int | None
    backend: Mapping[str, str]
    isa: Mapping[str, str | None]
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[Any, ...] = ()
    conv_layout: str = "DS"
    one_state: bool = False


def cpu_attn_views(cache: Any, isa: str = "vec") -> tuple[Any, Any]:
    """K and V of one CPU_ATTN layer tensor ``[blocks, heads, block_size, 2 * head_dim]``, as the
    ``vec`` kernels read them: K ``[blocks, heads, block_size, head_dim]`` through the transposed
    ``[head_dim][block_size]`` half, V the second half of vLLM's ``[blocks, heads, 2 * bs, hd]`` view.
    ``isa="amx"`` (bfloat16): K ``[.., bs/16, hd/2, 16, 2]`` (token ``16 t1 + t0``, element ``2 d1 + d0``)
    and V ``[.., hd/16, bs/2, 16, 2]`` permuted to the same order (token ``2 t1 + t0``, element
    ``16 d1 + d0``), both read as ``"page head token1 d1 token0 d0"`` (:data:`CPU_ATTN_AXES`)."""
    blocks, heads, bs, two_hd = (int(n) for n in cache.shape)
    hd = two_hd // 2
    if isa == "amx":
        kv = cache.view(blocks, heads, 2, bs * hd)
        k = kv[:, :, 0].view(blocks, heads, bs // 16, hd // 2, 16, 2)
        v = kv[:, :, 1].view(blocks, heads, hd // 16, bs // 2, 16, 2).permute(0, 1, 3, 2, 5, 4)
        return k, v
    k = cache.view(blocks, heads, 2, hd, bs)[:, :, 0].transpose(-1, -2)
    v = cache.view(blocks, heads, 2 * bs, hd).chunk(2, dim=2)[1]
    return k, v


def mamba_state_views(cache: Any, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> list[Any]:
    """The state tensors of one mamba layer's raw page tensor ``[blocks, 1, 1, page_bytes]``: per
    block, each state's ``prod(shape) * dtype.itemsize`` bytes after the previous one, viewed as
    ``[blocks, *shape]`` of ``dtype``. Raises :class:`~kvgeom_nixl.errors.ExecutorError` when the
    states do not fit the page."""
    dims = tuple(int(n) for n in cache.shape)
    if len(dims) != 4 or dims[1:3] != (1, 1) or int(cache.element_size()) != 1:
        raise ExecutorError("kv_caches[mamba].shape", f"shape {dims} of {int(cache.element_size())}-byte elements "
                            "is not a raw state page [blocks, 1, 1, bytes] of bytes", actual=dims,
                            expected="[blocks, 1, 1, page_bytes], int8")
    pages = cache[:, 0, 0]
    out, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        count = 1
        for n in shape:
            count *= int(n)
        nbytes = count * int(dtype.itemsize)
        if offset + nbytes > dims[3]:
            raise ExecutorError("kv_caches[mamba].shape[3]", f"states {list(shapes)} need more than the page's "
                                f"{dims[3]} bytes", actual=dims[3], expected=f">= {offset + nbytes}")
        out.append(pages[:, offset:offset + nbytes].view(dtype).view(dims[0], *(int(n) for n in shape)))
        offset += nbytes
    return out


def _state_layers(group: CacheGroup, spec: Any, kv_caches: Mapping[str, Any]) -> list[LayerTensors]:
    """One :class:`kvgeom.LayerTensors` per layer of a mamba group: the conv state's sections side by
    side along its channels, then the temporal state (``spec``: kvgeom's :class:`kvgeom.StateSpec`)."""
    path = f"kv_cache_groups[{group.name!r}]"
    names = [sec.name for sec in spec.sections]
    if len(group.state_shapes) != 2 or len(names) < 2 or len(group.state_shapes[1]) != 3:
        raise ExecutorError(f"{path}.state_shapes", f"state tensors {list(group.state_shapes)} with sections "
                            f"{names}", actual=list(group.state_shapes),
                            expected="a conv state (2 dims) and a temporal state (heads, head_dim, state)",
                            fix="the connector moves mamba2 and GDN states")
    conv_axes = "page channel row" if group.conv_layout == "DS" else "page row channel"
    out = []
    for layer in group.layers:
        if layer not in kv_caches:
            raise ExecutorError(f"kv_caches[{layer!r}]", "a layer of the KV-cache config has no registered tensor",
                                actual=None, expected="a tensor", fix="register every layer of every group")
        conv, temporal = mamba_state_views(kv_caches[layer], group.state_shapes, group.state_dtypes)
        out.append(LayerTensors(group.name, {" ".join(names[:-1]): conv_axes, names[-1]: "page channel hd ds"},
                                {" ".join(names[:-1]): conv, names[-1]: temporal}, name=layer))
    return out


def _layer(group: CacheGroup, layer: str, kv_caches: Mapping[str, Any]) -> tuple[Any, int]:
    """The CPU_ATTN tensor of ``layer`` (checked) and its kernel block size."""
    path = f"kv_caches[{layer!r}]"
    backend = group.backend.get(layer, "")
    if backend != CPU_ATTN:
        raise ExecutorError(f"{path}.backend", f"attention backend {backend or 'unknown'!r}: the connector reads "
                            f"{CPU_ATTN} caches only (docs/design.md §15.3)", actual=backend, expected=CPU_ATTN,
                            fix="run vLLM's CPU attention backend (float32), or add this backend's views to "
                            "kvgeom_nixl.vllm.caches")
    isa = group.isa.get(layer)
    if isa not in CPU_ATTN_ISAS:
        raise ExecutorError(f"{path}.isa", f"CPU_ATTN kernel {isa!r}: its page layout is not described here "
                            "(docs/design.md §10.1)", actual=isa, expected=list(CPU_ATTN_ISAS),
                            fix="run float32 (vec) or bfloat16 (amx)")
    if layer not in kv_caches:
        raise ExecutorError(path, "a layer of the KV-cache config has no registered tensor", actual=None,
                            expected="a tensor", fix="register every layer of every group")
    t = kv_caches[layer]
    shape = tuple(int(n) for n in t.shape)
    if len(shape) != 4 or shape[3] % 2 or shape[2] < 1:
        raise ExecutorError(f"{path}.shape", f"shape {shape} is not CPU_ATTN's [blocks, heads, block_size, "
                            "2 * head_dim]", actual=shape, expected="4 dimensions, the last even")
    kernel = shape[2]
    if group.block_size % kernel:
        raise ExecutorError(f"{path}.shape[2]", f"a {kernel}-token kernel block does not divide the group's "
                            f"{group.block_size}-token block", actual=kernel, expected=f"a divisor of {group.block_size}")
    return t, kernel


def _mla_layer(group: CacheGroup, layer: str, kv_caches: Mapping[str, Any]) -> tuple[Any, int]:
    """The CPU_MLA tensor of ``layer`` (checked: ``[blocks, 1, block_size, latent]``) and its kernel block."""
    path = f"kv_caches[{layer!r}]"
    backend = group.backend.get(layer, "")
    if backend not in CPU_MLA_BACKENDS:
        raise ExecutorError(f"{path}.backend", f"MLA backend {backend or 'unknown'!r}: the connector reads "
                            f"{list(CPU_MLA_BACKENDS)} MLA caches only", actual=backend, expected=list(CPU_MLA_BACKENDS),
                            fix="run vLLM's CPU MLA backend (float32)")
    if layer not in kv_caches:
        raise ExecutorError(path, "a layer of the KV-cache config has no registered tensor", actual=None,
                            expected="a tensor", fix="register every layer of every group")
    t = kv_caches[layer]
    shape = tuple(int(n) for n in t.shape)
    if len(shape) != 4 or shape[1] != 1 or shape[2] < 1:
        raise ExecutorError(f"{path}.shape", f"shape {shape} is not CPU_MLA's [blocks, 1, block_size, latent]",
                            actual=shape, expected="4 dimensions, one head")
    if group.block_size % shape[2]:
        raise ExecutorError(f"{path}.shape[2]", f"a {shape[2]}-token kernel block does not divide the group's "
                            f"{group.block_size}-token block", actual=shape[2], expected=f"a divisor of {group.block_size}")
    return t, shape[2]


def geometry_from_kv_caches(kv_caches: Mapping[str, Any], groups: Sequence[CacheGroup], *, tp: int,
                            name: str, model: ModelSpec | None = None) -> tuple[EngineGeometry, list[LayerTensors]]:
    """This rank's geometry and the :class:`kvgeom.LayerTensors` it was read from (the endpoint
    registers exactly those, :func:`kvgeom_nixl.region_buffers`), for vLLM's ``kv_caches`` (layer
    name -> tensor) and the engine's groups. ``name`` is the engine's: every rank of one engine
    advertises one geometry. ``model``: kvgeom's reading of vLLM's KV-cache config, needed for
    mamba groups (their :class:`kvgeom.StateSpec`, found by group name). Raises
    :class:`~kvgeom_nixl.errors.ExecutorError` for a cache this module does not describe and
    :class:`kvgeom.GeometryError` for tensors kvgeom refuses."""
    if not groups:
        raise ExecutorError("kv_cache_groups", "no KV-cache group to transfer", actual=0, expected=">= 1")
    specs: list[Any] = []
    layers: list[LayerTensors] = []
    kernels: set[int] = set()
    logical: set[int] = set()
    dtype = ""
    given = {g.name: g for g in model.groups} if model is not None else {}
    for group in groups:
        if group.kind == "mamba":
            spec = given.get(group.name)
            if not isinstance(spec, StateSpec):
                raise ExecutorError(f"kv_cache_groups[{group.name!r}]", "a mamba group needs kvgeom's StateSpec of "
                                    "it (model=)", actual=type(spec).__name__, expected="StateSpec",
                                    fix="pass engine_from_vllm_config(...).model")
            if not group.one_state:
                raise ExecutorError(f"kv_cache_groups[{group.name!r}].mamba_cache_mode", "a state per block (prefix "
                                    "caching of mamba states) is not moved by this connector", actual="align or all",
                                    expected="none", fix="run the hybrid with enable_prefix_caching=False")
            specs.append(spec)
            layers += _state_layers(group, spec, kv_caches)
            continue
        if group.kind not in ("full", "sliding", "mla") or (group.kind == "sliding") != bool(group.window):
            raise ExecutorError(f"kv_cache_groups[{group.name!r}].kind", f"group kind {group.kind!r} with window "
                                f"{group.window!r}", actual=group.kind,
                                expected="full, sliding with a window, mla or mamba",
                                fix="the connector moves attention groups (full, sliding window, MLA) and mamba "
                                "states only")
        if not group.layers:
            raise ExecutorError(f"kv_cache_groups[{group.name!r}].layers", "a group without layers", actual=0,
                                expected=">= 1")
        head_bytes = 0
        for layer in group.layers:
            t, kernel = _mla_layer(group, layer, kv_caches) if group.kind == "mla" else _layer(group, layer, kv_caches)
            kernels.add(kernel)
            logical.add(group.block_size)
            if group.kind == "mla":  # one latent per token: [blocks, 1, block_size, latent]
                layers.append(LayerTensors(group.name, "page head token dim", t, name=layer))
                head_bytes = int(t.shape[3]) * int(t.element_size())
            else:
                isa = str(group.isa.get(layer))
                layers.append(LayerTensors(group.name, CPU_ATTN_AXES[isa], cpu_attn_views(t, isa), name=layer))
                head_bytes = int(t.shape[3]) // 2 * int(t.element_size())
            dtype = str(t.dtype).removeprefix("torch.")
        specs.append(AttentionSpec(group.name, group.kind, num_layers=len(group.layers),
                                   num_kv_heads=1 if group.kind == "mla" else group.total_kv_heads,
                                   head_bytes=head_bytes, window_tokens=group.window if group.kind == "sliding" else None))
    if len(kernels) != 1 or len(logical) != 1:
        raise ExecutorError("kv_caches", f"groups with different block sizes (kernel {sorted(kernels)}, logical "
                            f"{sorted(logical)})", actual=sorted(kernels | logical), expected="one block size",
                            fix="the connector reads one block size per engine")
    kernel, block = kernels.pop(), logical.pop()
    spec_model = ModelSpec("vllm", specs, dtype=dtype)
    geo = EngineGeometry.from_tensors(spec_model, tp=tp, layers=layers, kernel_block_tokens=kernel,
                                      blocks_per_logical=block // kernel, name=name)
    return geo, layers
