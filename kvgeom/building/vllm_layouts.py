"""vLLM's attention page layouts, per vLLM version and backend, as kvgeom page strides (docs/design.md §10.2).

vLLM 0.32 (``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``) gives every layer
one logical view ``[B, H, N, C]``: blocks, heads, tokens and a cell of ``C`` bytes, laid out by the
resolved ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``), a permutation of ``[L, B, H, N, C]``
whose L and B strides come from the tensor and whose inner strides are dense
(``compute_layout_strides`` in ``vllm/v1/kv_cache_interface.py``)::

    LBNHC (NHD)   [L][B][N][H][C]      token_stride = H*C, head_stride = C
    LBHNC (HND)   [L][B][H][N][C]      head_stride = N*C,  token_stride = C
    BLNHC, BLHNC  [B][L][...]          every layer's page inside one block row (one region)
    BHLNC         [B][H][L][N][C]      head_stride = L*N*C, layer l at l*N*C
    LHBNC         heads outside blocks: a page is not one range, refused

The backend reads the cell (``C = (head_size + head_size_v) * dtype bytes``):

    FLASH_ATTN, FLASHINFER, TRITON_ATTN   K | V side by side in each (head, token) cell:
                                          kv_stride = head_size * dtype bytes
    CPU_ATTN                              [B, H, N, 2*hd] viewed as [B, H, 2N, hd] and chunked:
                                          each head is [K: N x hd][V: N x hd]; inside K and V the
                                          kernel's order (K transposed for vec): a per-plane layout
    MLA backends                          one latent per token (head_size_v = 0)

The older field set (``KVCacheTensor(size, shared_by)``, before the layout descriptor) placed
K/V by the backend's ``get_kv_cache_shape``: FLASH_ATTN ``(2, blocks, tokens, heads, dim)`` (a K
and a V region), FLASHINFER / TRITON_ATTN ``(blocks, 2, tokens, heads, dim)``, MLA backends
``(blocks, tokens, head_size)``, NHD or HND; in hybrids every backend blocks-first.

Worked number: Llama-3-8B on TP2, FLASH_ATTN, LBNHC, 16-token blocks, bf16: ``C = (128 + 128) * 2 =
512`` B, ``token_stride = 4 * 512 = 2048``, ``head_stride = 512``, ``kv_stride = 256``, a page of
``16 * 4 * 512 = 32,768`` B; one region per layer (the older field set: two of 16,384 B).
"""

from __future__ import annotations

from typing import Literal

from ..errors import GeometryError, value_text
from ..values.layout import PageLayout
from ..values.planes import PlanesLayout
from ..values.planes import cpu_attn_layout as planes_cpu_attn_layout

__all__ = ["VLLM_BACKENDS", "VLLM_LEGACY_BACKENDS", "VLLM_KV_CACHE_LAYOUTS", "layout_order", "inner_strides",
           "cell_layout", "cpu_attn_layout", "legacy_layout", "CPU_ATTN_K_TILE"]

VLLM_BACKENDS: dict[str, str] = {
    "FLASH_ATTN": "cell", "FLASHINFER": "cell", "TRITON_ATTN": "cell", "CPU_ATTN": "cpu",
    "FLASHMLA": "mla", "FLASH_ATTN_MLA": "mla", "TRITON_MLA": "mla", "CUTLASS_MLA": "mla", "FLASHINFER_MLA": "mla",
    "CPU_MLA": "mla", "AMX_MLA": "mla",
}
"""vLLM 0.32's attention backends by how they read the ``[B, H, N, C]`` cell: K | V per cell
(``cell``), the CPU backend's per-head K rows then V rows (``cpu``), one latent (``mla``)."""

VLLM_LEGACY_BACKENDS: dict[str, str] = {
    "FLASH_ATTN": "kv_first", "FLASHINFER": "blocks_first", "TRITON_ATTN": "blocks_first",
    "FLASHMLA": "mla", "FLASH_ATTN_MLA": "mla", "TRITON_MLA": "mla", "CUTLASS_MLA": "mla", "FLASHINFER_MLA": "mla",
}
"""The older field set's backends by how ``get_kv_cache_shape`` placed K/V: ``(2, blocks, ...)``
(kv_first), ``(blocks, 2, ...)`` (blocks_first) or ``(blocks, tokens, head_size)`` (mla)."""

_L, _B, _H, _N, _C = 0, 1, 2, 3, 4
VLLM_KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
    "NHD": (0, 1, 3, 2, 4), "HND": (0, 1, 2, 3, 4),
}
"""vLLM's ``KVCacheLayout`` members (physical order of the logical ``[L, B, H, N, C]`` axes) and
the legacy names ``VLLM_KV_CACHE_LAYOUT`` accepts for two of them (NHD = LBNHC, HND = LBHNC)."""

CPU_ATTN_K_TILE = 32
"""Tokens per K-row tile of the CPU backend (docs/design.md §10.2): plain token order at 32."""


def layout_order(name: str, path: str) -> tuple[int, ...]:
    """The axis order of a layout name, refusing unknown names and the layouts kvgeom cannot page."""
    if not isinstance(name, str) or name not in VLLM_KV_CACHE_LAYOUTS:
        raise GeometryError(path, f"unknown KV-cache layout {value_text(name, 60)}", actual=value_text(name, 60),
                            expected=sorted(VLLM_KV_CACHE_LAYOUTS), fix="pass KVCacheConfig.kv_cache_layout")
    order = VLLM_KV_CACHE_LAYOUTS[name]
    if order.index(_H) < order.index(_B) or order.index(_N) < order.index(_B):
        raise GeometryError(path, f"{name} puts heads outside blocks: a kernel page is not one byte range",
                            actual=name, expected="a layout with B before H and N (LBHNC, LBNHC, BL..., BHLNC)",
                            fix="run with VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC")
    return order


def inner_strides(order: tuple[int, ...], *, layers: int, heads: int, tokens: int, cell: int,
                  layer_stride: int) -> tuple[int, int]:
    """``(head_stride, token_stride)`` in bytes, as ``compute_layout_strides`` makes them: dense from
    the innermost axis out, the L stride fixed by the tensor (it sits between H and N in BHLNC)."""
    sizes = {_L: layers, _H: heads, _N: tokens, _C: cell}
    strides: dict[int, int] = {}
    current = 1
    for dim in reversed(order):
        if dim == _B:
            break  # B and everything outside it come from the tensor
        strides[dim] = layer_stride if dim == _L else current
        current = strides[dim] * sizes[dim]
    return strides[_H], strides[_N]


def cell_layout(*, heads: int, tokens: int, head_bytes: int, head_stride: int, token_stride: int,
                planes: int) -> PageLayout:
    """K | V side by side in each (head, token) cell (``planes`` 2), or MLA's one latent (``planes`` 1,
    kv_stride as a dense plane, the convention of ``EngineGeometry.from_tensors``)."""
    kv = head_bytes if planes == 2 else heads * tokens * head_bytes
    return PageLayout(kv_stride=kv, head_stride=head_stride, token_stride=token_stride)


def cpu_attn_layout(*, heads: int, tokens: int, head_bytes: int, head_stride: int, token_stride: int,
                    element_bytes: int, isa: str = "vec") -> PlanesLayout:
    """The CPU backend's page (vLLM 0.32 ``cpu_attn.py``) as a per-plane layout (docs/design.md §3.5).

    vLLM views each layer's ``[B, H, N, 2 * hd]`` cache as ``[B, H, 2N, hd]`` and chunks it: per head,
    N K rows then N V rows. The config says only the head and cell strides; the order of the bytes
    inside K and V is the kernel's (:func:`kvgeom.cpu_attn_layout`: ``vec``/``vec16`` store K
    transposed, ``[hd][N]``, at every block size, 32 included; ``amx`` tiles 16 tokens). So the config
    must be LBHNC-like (a head's ``2N`` rows together, cells of ``2 * hd`` elements), and the kernel
    (``isa``, vLLM's ``layer.isa``: ``vec`` for float32 on x86) decides the rest.
    """
    if tokens < CPU_ATTN_K_TILE or tokens % CPU_ATTN_K_TILE:
        raise GeometryError("kernel_block_size", f"CPU_ATTN pages are a multiple of {CPU_ATTN_K_TILE} tokens, got "
                            f"{tokens}", actual=tokens, expected=f"a multiple of {CPU_ATTN_K_TILE}",
                            fix="pass vLLM's block size (the CPU backend does not split blocks)")
    if token_stride != 2 * head_bytes or head_stride != 2 * tokens * head_bytes:
        raise GeometryError("kv_cache_layout", "CPU_ATTN reads each head's cells as one [2N, hd] range: the "
                            "layout must keep a head's tokens together", actual=(head_stride, token_stride),
                            expected=(2 * tokens * head_bytes, 2 * head_bytes), fix="vLLM's CPU backend runs LBHNC")
    return planes_cpu_attn_layout(heads=heads, block_size=tokens, head_bytes=head_bytes,
                                  element_bytes=element_bytes, isa=isa)


def legacy_layout(kind: str, *, heads: int, tokens: int, head_bytes: int,
                  nhd_or_hnd: Literal["NHD", "HND"]) -> PageLayout:
    """The older field set's page: ``kv_first`` (K and V regions), ``blocks_first`` or ``mla``."""
    if kind == "mla":
        return PageLayout.hnd(heads=1, tokens=tokens, head_bytes=head_bytes, planes=1)
    maker = PageLayout.hnd if nhd_or_hnd == "HND" else PageLayout.nhd
    return maker(heads=heads, tokens=tokens, head_bytes=head_bytes, kv="split" if kind == "kv_first" else "packed")
