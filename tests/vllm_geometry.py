"""Run under the vLLM venv (tests/vllm_env.py: run_in_vllm): vLLM's own KV-cache configs, read by kvgeom.

For each engine below the script builds the per-layer specs with vLLM's classes, lets vLLM group
them (``get_kv_cache_groups``, with or without the hybrid manager) and size them
(``get_kv_cache_config_from_groups``), and allocates the cache with vLLM's own
``allocate_kv_cache`` on CPU. Then:

* ``config``: kvgeom's :func:`engine_from_vllm_config` on vLLM's ``KVCacheConfig`` object;
* ``tensors``: ``EngineGeometry.from_tensors`` on the views the backend reads from vLLM's
  allocation (the one-line views of each backend's forward, cited per backend; mamba layers
  through vLLM's own ``MambaBase.bind_kv_cache``);
* ``nixl``: each layer as NIXL registers it (``NixlConnectorWorker.register_kv_caches``: base
  ``data_ptr()``, block length ``page_size_bytes // ratio``, block stride ``stride(0)``), against the
  region kvgeom puts the layer in.

and prints one JSON line: per case, whether the two geometries agree region by region and group
by group (layouts and views), the numbers, and the first difference. A control case describes
an LBHNC allocation as LBNHC and must disagree.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import _layout_from_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.utils import allocate_kv_cache

from kvgeom import EngineGeometry, GeometryError
from kvgeom.building import engine_from_vllm_config, vllm_region_layers
from kvgeom.values import LayerTensors

BF16, F32 = torch.bfloat16, torch.float32


def vllm_config(layout: str, hybrid: bool) -> Any:
    """The few VllmConfig fields vLLM's grouping and sizing read, as a namespace."""
    cache = types.SimpleNamespace(kv_cache_layout=layout, num_gpu_blocks_override=None,
                                  prefix_cache_retention_interval=None, mamba_cache_mode="none")
    cache.get_resolved_kv_cache_layout = lambda: _layout_from_name(layout)
    return types.SimpleNamespace(
        cache_config=cache, scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid),
        attention_config=types.SimpleNamespace(hisparse_config=None), speculative_config=None,
        model_config=None, parallel_config=types.SimpleNamespace(decode_context_parallel_size=1,
                                                                 pipeline_parallel_size=1))


def attn(block: int, heads: int, head: int, dtype: torch.dtype = BF16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)


def case_specs(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-layer specs of one worker (this rank's heads and state shapes) and the engine's facts."""
    if name.startswith("llama3-8b-tp2"):  # 8 KV heads of 128 on TP2: 4 per rank (4 of 32 layers)
        return {f"model.layers.{i}.self_attn.attn": attn(16, 4, 128) for i in range(4)}, {"tp": 2}
    if name == "mistral-sliding":  # every layer sliding (window 4096 scaled to 64), CPU backend, block 32
        return {f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64,
                                                                      dtype=F32, sliding_window=64)
                for i in range(3)}, {"tp": 1}
    if name.startswith("gemma2"):  # even layers sliding (window 4096 scaled to 128), odd full
        specs: dict[str, Any] = {}
        for i in range(4):
            specs[f"model.layers.{i}.self_attn.attn"] = (
                SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=F32, sliding_window=128)
                if i % 2 == 0 else attn(32, 2, 64, F32))
        return specs, {"tp": 1}
    if name == "deepseek-v3-mla-tp8":  # latent 512 + rope 64 = 576 bf16, replicated on every rank
        return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                                                                     dtype=BF16) for i in range(3)}, {"tp": 8}
    if name.startswith("nemotron-h-tp2"):  # Mamba2 (scaled: 8 heads of 64, state 16, 2 groups, conv 4) + GQA
        tp = 2
        conv_dim = 512 + 2 * 2 * 16
        sd = name.endswith("-sd")  # VLLM_SSM_CONV_STATE_LAYOUT=SD: (kernel - 1, dim), vLLM's default
        shapes = ((3, conv_dim // tp) if sd else (conv_dim // tp, 3), (8 // tp, 64, 16))
        state = conv_dim // tp * 3 * 2 + 8 // tp * 64 * 16 * 4
        per_16 = 2 * 16 * (2 // tp) * 128 * 2  # a 16-token attention page on this rank
        pages = -(-state // per_16)
        block = 16 * pages
        specs = {f"model.layers.{i}.mixer": MambaSpec(block_size=block, shapes=shapes, dtypes=(BF16, F32),
                                                      page_size_padded=pages * per_16,
                                                      mamba_type=MambaAttentionBackendEnum.MAMBA2)
                 for i in (0, 1, 3, 4)}
        specs.update({f"model.layers.{i}.mixer.attn": attn(block, 2 // tp, 128) for i in (2, 5)})
        return specs, {"tp": tp, "state": state, "kernel": 16, "ppl": pages, "conv": "SD" if sd else "DS"}
    raise KeyError(name)


CASES = [  # (name, attention backend, layout, hybrid manager)
    ("llama3-8b-tp2-nhd", "FLASH_ATTN", "LBNHC", True),
    ("llama3-8b-tp2-hnd", "FLASH_ATTN", "LBHNC", True),
    ("llama3-8b-tp2-blhnc", "FLASH_ATTN", "BLHNC", True),
    ("mistral-sliding", "CPU_ATTN", "LBHNC", True),
    ("gemma2-hybrid", "CPU_ATTN", "LBHNC", True),
    ("gemma2-no-hybrid", "CPU_ATTN", "LBHNC", False),
    ("deepseek-v3-mla-tp8", "FLASHMLA", "LBHNC", True),
    ("nemotron-h-tp2", "FLASH_ATTN", "LBHNC", True),
    ("nemotron-h-tp2-sd", "FLASH_ATTN", "LBHNC", True),
]


def backend_views(backend: str, spec: Any, cache: torch.Tensor) -> tuple[str, Any]:
    """The tensors the backend's forward reads from the ``[B, H, N, C]`` view, and their axes."""
    if isinstance(spec, MLAAttentionSpec):
        return "page head token dim", cache  # one latent per (head slot, token)
    if backend == "CPU_ATTN":  # vllm/v1/attention/backends/cpu_attn.py, do_kv_cache_update
        # V: the second half of each head's (2N, hd) rows, token order. K: the first half holds K
        # transposed for the vec kernel (float32 here), [hd][N] -- read as a (token, dim) view of it
        b, h, n, c = cache.size()
        hd = c // 2
        value = cache.view((b, h, n * 2, hd)).chunk(2, dim=2)[1]
        key = cache.view((b, h, 2, hd, n))[:, :, 0].transpose(-1, -2)
        return "page head token dim", (key, value)
    # flash_attn.py / triton_attn.py forward: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    key, value = cache.transpose(1, 2).split(spec.head_size, dim=-1)
    return "page token head dim", (key, value)


def mamba_views(spec: MambaSpec, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's own unpacking of a mamba page (MambaBase.bind_kv_cache), conv then temporal state."""
    layer = types.SimpleNamespace(get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes)
    MambaBase.bind_kv_cache(layer, cache)  # type: ignore[arg-type]
    conv, temporal = layer.kv_cache
    return {"x B C": conv, "ssm": temporal}


def compare(a: EngineGeometry, b: EngineGeometry) -> str:
    """The first difference between two geometries, region by region and group by group ("" if none)."""
    if (a.kernel_block_tokens, a.blocks_per_logical) != (b.kernel_block_tokens, b.blocks_per_logical):
        return f"kernel pages {a.kernel_block_tokens} x {a.blocks_per_logical} vs {b.kernel_block_tokens} x " \
               f"{b.blocks_per_logical}"
    if len(a.regions) != len(b.regions):
        return f"{len(a.regions)} regions vs {len(b.regions)}"
    for i, (x, y) in enumerate(zip(a.regions, b.regions)):
        if x != y:
            return f"region {i}: {x} vs {y}"
    for g, (x, y) in enumerate(zip(a.groups, b.groups)):
        if x.layout != y.layout:
            return f"group {g} layout: {x.layout} vs {y.layout}"
        for li, (u, v) in enumerate(zip(x.views, y.views)):
            if u != v:
                return f"group {g} layer {li} view: {u} vs {v}"
    return ""


def run_case(name: str, backend: str, layout: str, hybrid: bool, describe_as: str | None = None,
             describe_backend: str | None = None) -> dict[str, Any]:
    specs, facts = case_specs(name)
    vc = vllm_config(layout, hybrid)
    groups = kv_cache_utils.get_kv_cache_groups(vc, dict(specs))
    page = sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    cfg = kv_cache_utils.get_kv_cache_config_from_groups(vc, groups, page * 3)
    cfg.kv_cache_layout = layout  # as the engine core records it (vllm/v1/engine/core.py)
    kernel = facts.get("kernel")
    kernels = [kernel if kernel and not isinstance(g.kv_cache_spec, MambaSpec) else g.kv_cache_spec.block_size
               for g in groups]
    kv = allocate_kv_cache(cfg, torch.device("cpu"), _layout_from_name(layout), kernel_block_sizes=kernels)
    out: dict[str, Any] = {"name": name, "backend": backend, "layout": layout, "hybrid": hybrid,
                           "groups": [type(g.kv_cache_spec).__name__ for g in groups], "num_blocks": cfg.num_blocks,
                           "tensors": len(cfg.kv_cache_tensors)}
    try:
        geo = engine_from_vllm_config(cfg, tp=facts["tp"], attention_backend=describe_backend or backend,
                                      kernel_block_size=kernel,
                                      kv_cache_layout=describe_as, conv_state_layout=facts.get("conv", "DS"),
                                      name=name)
    except GeometryError as e:
        out.update(refused=e.path, error=str(e))
        return out
    layers: list[LayerTensors] = []
    kgroup = {ln: geo.model.groups[gi].name for gi, g in enumerate(groups) for ln in g.layer_names}
    order = [ln for t in cfg.kv_cache_tensors for ln in t.layers]
    spec_of = {ln: g.kv_cache_spec for g in groups for ln in g.layer_names}
    for ln in sorted(order, key=lambda n: order.index(n)):
        spec = spec_of[ln]
        if isinstance(spec, MambaSpec):
            conv_axes = "page row channel" if facts.get("conv") == "SD" else "page channel row"
            layers.append(LayerTensors(kgroup[ln], {"x B C": conv_axes, "ssm": "page channel hd st"},
                                       mamba_views(spec, kv[ln]), name=ln))
        else:
            axes, tensors = backend_views(backend, spec, kv[ln])
            layers.append(LayerTensors(kgroup[ln], axes, tensors, name=ln))
    # the layers in kvgeom's group order (from_tensors numbers layers per group in the order given)
    layers.sort(key=lambda lt: [g.name for g in geo.model.groups].index(lt.group))
    try:
        ten = EngineGeometry.from_tensors(geo.model, tp=facts["tp"], layers=layers, name=name,
                                          state_layout=None if facts.get("conv") != "SD" else "state_major")
    except GeometryError as e:
        out.update(tensors_error=str(e))
        return out
    out["diff"] = compare(geo, ten)
    if backend == "CPU_ATTN":  # where kvgeom says head 1's K and V of token 5 (layer 0, page 0) start
        out["cpu_probe"] = [geo.attention_address(0, 0, plane, 0, 5, 1)[1].item()
                            if hasattr(geo.attention_address(0, 0, plane, 0, 5, 1)[1], "item")
                            else int(geo.attention_address(0, 0, plane, 0, 5, 1)[1]) for plane in (0, 1)]
    # NIXL's registration (register_kv_caches): per layer base data_ptr(), block_len page_size_bytes // ratio
    # (a mamba page whole), block stride stride(0); layers at one base share one NIXL region
    storage = next(iter(kv.values())).untyped_storage().data_ptr()
    ratio = geo.blocks_per_logical
    nixl_bad: list[str] = []
    by_base: dict[int, list[str]] = {}
    for ln in order:
        by_base.setdefault(kv[ln].data_ptr(), []).append(ln)
    kvgeom_regions = vllm_region_layers(cfg)
    for r, names in enumerate(kvgeom_regions):
        for ln in names:
            cache, spec = kv[ln], spec_of[ln]
            state = isinstance(spec, MambaSpec)
            block_len = spec.page_size_bytes if state else spec.page_size_bytes // ratio
            stride = cache.stride(0) * cache.element_size()
            want = geo.regions[r].page_bytes * (ratio if state else 1)
            if stride != want or block_len > want:
                nixl_bad.append(f"{ln}: NIXL block_len {block_len} stride {stride}, kvgeom region {r} page {want}")
            g = kgroup[ln]
            gi = [x.name for x in geo.model.groups].index(g)
            li = [x for x in groups[gi].layer_names].index(ln)
            view = geo.groups[gi].views[li]
            offset = view.offset
            if cache.data_ptr() - storage - offset != (0 if layout.startswith("B") else
                                                       by_base and min(kv[x].data_ptr() for x in names) - storage):
                nixl_bad.append(f"{ln}: NIXL base {cache.data_ptr() - storage} vs kvgeom view offset {offset}")
    if layout.startswith("L") and sorted(map(sorted, by_base.values())) != sorted(map(sorted, kvgeom_regions)):
        nixl_bad.append(f"NIXL regions {len(by_base)} (layers by base) vs kvgeom {len(kvgeom_regions)}")
    out["nixl_diff"] = nixl_bad[:3]
    out["nixl_regions"] = len(by_base)
    out.update(
        regions=len(geo.regions), tensor_regions=len(ten.regions), page_bytes=geo.regions[0].page_bytes,
        kernel=geo.kernel_block_tokens, ppl=geo.blocks_per_logical,
        spec_page_size_bytes=[g.kv_cache_spec.page_size_bytes for g in groups],
        strides=[[x.layout.kv_stride, x.layout.head_stride, x.layout.token_stride] if hasattr(x.layout, "kv_stride")
                 else str(x.layout) for x in geo.groups],
        offsets=[[v.offset for v in x.views] for x in geo.groups],
        model=[[g.name, g.kind, g.num_kv_heads, g.head_bytes, g.window_tokens] if hasattr(g, "head_bytes") else
               [g.name, "state", [[s.name, s.channels, s.unit_bytes, s.rows] for s in g.sections]]
               for g in geo.model.groups],
        state_bytes=facts.get("state"),
    )
    return out


def main() -> None:
    results = [run_case(*c) for c in CASES]
    # control: vLLM allocated LBHNC, kvgeom told it is LBNHC -- the comparison must see it
    control = run_case("llama3-8b-tp2-hnd", "FLASH_ATTN", "LBHNC", True, describe_as="LBNHC")
    control["name"] = "control-lbhnc-described-as-lbnhc"
    # control: CPU_ATTN's [head][K rows][V rows] page described as FLASH_ATTN's K | V cells
    control_cpu = run_case("mistral-sliding", "CPU_ATTN", "LBHNC", True, describe_backend="FLASH_ATTN")
    control_cpu["name"] = "control-cpu-attn-described-as-flash-attn"
    # refusals: CPU_ATTN at 64 tokens (tiled K rows), and a layout with heads outside blocks
    refused: list[dict[str, Any]] = []
    specs64 = {f"l{i}": SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=F32, sliding_window=64)
               for i in range(2)}
    vc = vllm_config("LBHNC", True)
    g64 = kv_cache_utils.get_kv_cache_groups(vc, specs64)
    cfg64 = kv_cache_utils.get_kv_cache_config_from_groups(vc, g64, 2 * g64[0].kv_cache_spec.page_size_bytes * 3)
    cfg64.kv_cache_layout = "LBHNC"
    for backend, layout in (("CPU_ATTN", None), ("FLASH_ATTN", "LHBNC")):
        try:
            g = engine_from_vllm_config(cfg64, tp=1, attention_backend=backend, kv_cache_layout=layout)
            probe = [int(g.attention_address(0, 0, plane, 0, 37, 1)[1]) for plane in (0, 1)]
            refused.append({"backend": backend, "layout": layout, "refused": None, "probe": probe})
        except GeometryError as e:
            refused.append({"backend": backend, "layout": layout, "refused": e.path, "error": str(e)})
    print(json.dumps({"cases": results, "controls": [control, control_cpu], "refused": refused}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
