"""kvgeom's description of one side of a vLLM conformance run, checked three ways (docs/design.md §10.6).

For each rank of a :class:`~kvgeom_nixl.vllm.engines.VllmSide` the geometry comes from
``EngineGeometry.from_tensors`` on the views vLLM's own backend reads and the regions vLLM's
NixlConnector registered (``kv_caches_base_addr``, ``block_stride_per_layer``, ``region_num_blocks``):

    CPU_ATTN   c = [B, H, N, 2 hd] (what vLLM registers)
               K: c.view(B, H, 2, hd, N)[:, :, 0].transpose(-1, -2)   (the vec kernel stores K transposed)
               V: c.view(B, H, 2N, hd).chunk(2, dim=2)[1]             both read as "page head token dim"
    CPU_MLA / AMX_MLA   c = [B, 1, N, 576]: "page head token dim", one latent plane
    mamba (hybrid)      vLLM's own unpacking (MambaBase.bind_kv_cache): conv (DS) and ssm state views

and is then held against two other readings before the kit may judge with it:

* **kvgeom's builders.** CPU_ATTN sides must equal ``EngineGeometry.build(layout="CPU_ATTN",
  cpu_isa=<vLLM's layer.isa>)``, and every side must equal ``engine_from_vllm_config`` on vLLM's
  ``KVCacheConfig`` (the adapter of §10.2), region by region and group by group.
* **vLLM's writer.** Every (token, dim) of one block of head 0 is written through the backend's own
  ``do_kv_cache_update`` with its own number and found; kvgeom's address of it
  (``attention_address`` plus ``attention_vector_bytes``) must be the same element.

A disagreement is a ``GeometryError`` naming what differs: the run reports the side as
UNDESCRIBABLE instead of judging with a wrong description.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from kvgeom import PageLayout

from .engines import VllmSide
from .patterns import decode_numbers, fresh_caches, numbers

__all__ = ["describe_side", "describe_controls", "element_map", "compare_geometries"]


def _check_model(side: VllmSide, model: Any, name: str) -> None:
    """The adapter's model must say what the side's tiny model is: per attention group its global KV
    heads, head bytes and kind, and per group its layers."""
    from kvgeom import AttentionSpec, GeometryError

    m, eb = side.model, side.model.torch_dtype.itemsize
    if len(model.groups) != len(side.groups()):
        raise GeometryError(f"{name}.model.groups", f"{len(model.groups)} groups for vLLM's {len(side.groups())}",
                            actual=len(model.groups), expected=len(side.groups()))
    for g, spec in zip(side.groups(), model.groups):
        got: tuple[Any, ...] = (spec.num_layers,)
        want: tuple[Any, ...] = (len(g.layers),)
        if g.kind != "mamba":
            got += (spec.num_kv_heads, spec.head_bytes, str(spec.kind.value)) if isinstance(spec, AttentionSpec) \
                else ("state",)
            want += (1, m.head_dim * eb, "mla") if g.kind == "mla" else (m.kv_heads, m.head_dim * eb, "full")
        if got != want:
            raise GeometryError(f"{name}.model.{g.name}", f"the adapter reads {got} (layers, heads, head bytes, "
                                f"kind), the model is {want}", actual=got, expected=want)


def _regions(side: VllmSide, rank: int) -> list[tuple[int, int]]:
    worker = side.worker(rank)
    bases = worker.kv_caches_base_addr[side.engine_id][rank]
    counts = worker.region_num_blocks or [worker.num_blocks] * len(bases)
    return [(int(b), int(n) * int(s)) for b, n, s in zip(bases, counts, worker.block_stride_per_layer)]


def _layer_tensors(side: VllmSide, rank: int) -> list[Any]:
    from kvgeom import LayerTensors

    out = []
    for g in side.groups():
        for lname in g.layers:
            cache = side.caches[rank][lname]
            if g.kind == "mla":  # (B, 1, N, 576)
                out.append(LayerTensors(g.name, "page head token dim", cache, name=lname))
            elif g.kind == "attn":  # CPU_ATTN (B, H, N, 2 hd): K transposed, then V in token order
                b, h, n, c = cache.shape
                hd = c // 2
                key = cache.view(b, h, 2, hd, n)[:, :, 0].transpose(-1, -2)
                value = cache.view(b, h, 2 * n, hd).chunk(2, dim=2)[1]
                out.append(LayerTensors(g.name, "page head token dim", (key, value), name=lname))
            else:
                conv, ssm = side.mamba_views(rank, lname)
                out.append(LayerTensors(g.name, {"x B C": "page channel row", "ssm": "page channel hd ds"},
                                        {"x B C": conv, "ssm": ssm}, name=lname))
    return out


def _single_plane(geo: Any, group: int) -> bool:
    spec = geo.model.groups[group]
    return getattr(spec, "planes", 2) == 1


def compare_geometries(a: Any, b: Any) -> str:
    """The first difference between two geometries, region by region and group by group ("" if none)."""
    if (a.kernel_block_tokens, a.blocks_per_logical) != (b.kernel_block_tokens, b.blocks_per_logical):
        return (f"kernel pages {a.kernel_block_tokens} x {a.blocks_per_logical} vs {b.kernel_block_tokens} x "
                f"{b.blocks_per_logical}")
    if len(a.regions) != len(b.regions):
        return f"{len(a.regions)} regions vs {len(b.regions)}"
    for i, (x, y) in enumerate(zip(a.regions, b.regions)):
        if x != y:
            return f"region {i}: {x} vs {y}"
    if len(a.groups) != len(b.groups):
        return f"{len(a.groups)} groups vs {len(b.groups)}"
    for g, (x, y) in enumerate(zip(a.groups, b.groups)):
        if _single_plane(a, g) and isinstance(x.layout, PageLayout) and isinstance(y.layout, PageLayout):
            x = attrs.evolve(x, layout=attrs.evolve(x.layout, kv_stride=y.layout.kv_stride))  # no second plane
        if x.layout != y.layout:
            return f"group {g} layout: {x.layout} vs {y.layout}"
        if tuple(x.views) != tuple(y.views):
            return f"group {g} views: {x.views} vs {y.views}"
    return ""


def element_map(side: VllmSide, group: Any) -> dict[int, np.ndarray]:
    """Where vLLM's writer puts each (token, dim) of block 1, head 0, layer ``group.layers[0]``: per
    plane, an int array ``[token, dim]`` of element indices from the start of head 0 of the block.

    Every element is written with its own number into a scratch cache through the backend's own
    update, then the block's elements are read back in memory order.
    """
    bs, hd, dt = side.block_size, side.model.head_dim, side.model.torch_dtype
    lname = group.layers[0]
    planes = 1 if group.kind == "mla" else 2
    heads = side.kv_heads if group.kind == "attn" else 1

    def probe(plane: int, per_token: bool) -> np.ndarray:
        """Per element of head 0 of block 1 (memory order): the token (or dim) written there, -1 if none.
        Tokens and dims are probed apart: both stay below 2**14, which bfloat16 numbers hold exactly."""
        scratch = fresh_caches(side, 0.0)[0]

        def number(i: int, t: torch.Tensor, p: int) -> torch.Tensor:
            tt = t.view(-1, 1, 1).expand(-1, side.kv_heads, hd)
            d = torch.arange(hd).view(1, 1, -1).expand(t.shape[0], side.kv_heads, hd)
            code = (tt if per_token else d) + 1 if p == plane else torch.zeros_like(tt)
            return numbers(code, dt).contiguous()

        side.write_tokens(0, [1], range(bs), number, caches=scratch)
        flat = (decode_numbers(scratch[lname][1].reshape(-1)) - 1).numpy()
        return flat[:flat.size // heads]

    out: dict[int, np.ndarray] = {}
    for plane in range(planes):
        tok, dim = probe(plane, True), probe(plane, False)
        where = np.full((bs, hd), -1, np.int64)
        found = np.flatnonzero(tok >= 0)
        where[tok[found], dim[found]] = found
        out[plane] = where
    return out


def _check_against_writer(side: VllmSide, geo: Any, name: str) -> None:
    from kvgeom import GeometryError

    eb = side.model.torch_dtype.itemsize
    bs, hd = side.block_size, side.model.head_dim
    for gi, g in enumerate(side.groups()):
        if g.kind == "mamba":
            continue
        for plane, where in element_map(side, g).items():
            region, off = geo.attention_address(gi, 0, plane, np.full(bs, 1), np.arange(bs), np.zeros(bs, np.int64))
            start = geo.regions[region].page_bytes + geo.groups[gi].views[0].offset  # block 1, head 0
            vec = geo.attention_vector_bytes(gi, plane)[::eb][:hd]
            ours = (np.asarray(off).reshape(-1, 1) + vec.reshape(1, -1) - start) // eb
            if not np.array_equal(ours, where):
                t, d = (int(x) for x in np.argwhere(ours != where)[0])
                raise GeometryError(
                    f"{name}.groups[{gi}].plane[{plane}]",
                    f"vLLM's {side.backend_name} writer puts token {t} dim {d} of head 0 at element {int(where[t, d])} "
                    f"of the block's head, kvgeom's geometry at {int(ours[t, d])}",
                    actual=int(ours[t, d]), expected=int(where[t, d]),
                    fix="describe the page the way the backend's cache update writes it")


def describe_side(side: VllmSide, rank: int, name: str, like: Any = None) -> Any:
    """kvgeom's geometry of one rank of ``side`` (see the module), or a ``GeometryError`` naming
    what kvgeom cannot say or where two readings disagree. ``like``: rank 0's geometry, already
    checked; another rank's (vLLM allocates every rank alike) must equal it, and is not checked again."""
    from kvgeom import EngineGeometry, GeometryError
    from kvgeom.building import engine_from_vllm_config

    if side.attention_backend not in ("CPU_ATTN", "CPU_MLA", "AMX_MLA"):
        raise GeometryError(f"{name}.backend", f"only CPU_ATTN and CPU_MLA / AMX_MLA caches are described here, got "
                            f"{side.attention_backend}", actual=side.attention_backend,
                            expected="CPU_ATTN, CPU_MLA or AMX_MLA")
    config = engine_from_vllm_config(side.kv_cache_config, tp=side.tp, attention_backend=side.attention_backend,
                                     cpu_isa=side.isa or "vec", conv_state_layout="DS",
                                     group_names=[g.name for g in side.groups()], model_name=f"tiny-{side.model.kind}",
                                     name=name)
    model = config.model
    _check_model(side, model, name)
    geo = EngineGeometry.from_tensors(model, tp=side.tp, layers=_layer_tensors(side, rank),
                                      regions=_regions(side, rank), name=name)
    readings: list[tuple[str, Any]] = [("engine_from_vllm_config", config)]
    if like is not None:
        readings = [("rank 0's", like)]
    elif side.attention_backend == "CPU_ATTN" and len(model.groups) == 1:
        readings.append((f"EngineGeometry.build(layout='CPU_ATTN', cpu_isa={side.isa!r})",
                         EngineGeometry.build(model, tp=side.tp, kernel_block_tokens=side.block_size,
                                              num_blocks=side.num_blocks, layout="CPU_ATTN", cpu_isa=side.isa,
                                              name=name)))
    for what, other in readings:
        diff = compare_geometries(geo, other)
        if diff:
            raise GeometryError(f"{name}.geometry", f"from_tensors on vLLM's views and {what} disagree: {diff}",
                                actual=diff, expected="equal geometries",
                                fix="the builder or the adapter misreads this vLLM page")
    if like is None:
        _check_against_writer(side, geo, name)
    return geo


def describe_controls(side: VllmSide) -> dict[str, str]:
    """Wrong descriptions of a CPU_ATTN side that the checks of :func:`describe_side` must refuse:
    a plain HND page (K in token order, as FLASH_ATTN-like backends store it) against vLLM's writer,
    and against ``from_tensors`` on vLLM's views. Each value is the refusal's text ("" if not refused)."""
    from kvgeom import EngineGeometry, GeometryError
    from kvgeom.building import engine_from_vllm_config

    name = "control"
    config = engine_from_vllm_config(side.kv_cache_config, tp=side.tp, attention_backend=side.attention_backend,
                                     cpu_isa=side.isa or "vec", group_names=[g.name for g in side.groups()],
                                     name=name)
    plain = EngineGeometry.build(config.model, tp=side.tp, kernel_block_tokens=side.block_size,
                                 num_blocks=side.num_blocks, layout="HND", name=name)
    out = {"writer_refuses_hnd": "", "tensors_differ_from_hnd": ""}
    try:
        _check_against_writer(side, plain, name)
    except GeometryError as e:
        out["writer_refuses_hnd"] = str(e)
    tensors = EngineGeometry.from_tensors(config.model, tp=side.tp, layers=_layer_tensors(side, 0),
                                          regions=_regions(side, 0), name=name)
    out["tensors_differ_from_hnd"] = compare_geometries(tensors, plain)
    return out
