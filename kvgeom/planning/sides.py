"""How the planner addresses one side of an attention group: per-layer regions and offsets, the page
layout's strides, and where a token slot and a head sit inside a page.

The direct strategy lands copies through D's own :class:`SideView`; the staged strategy passes an
*arrived* view (a subclass with other slot and head offsets) as the landing place, so the row
builder never knows which strategy it serves::

    SideView(engine, group)                slot_offset(s) = s * token_stride, head_offset(h) = h * head_stride
    staged ArrivedView(engine, group, a)   sub-page of K_s tokens: (s // K_s) * sub_bytes + (s % K_s) * ts

    per-plane layout (§3.5)                slot_offset(s, plane): the plane's token modes; cut every
                                           affine_tokens (CPU_ATTN K at block 64: every 32 tokens)

Worked number: D HND, 2 heads of 256 B, K = 16: slot 5 sits at ``5 * 256 = 1280`` and head 1 at
``16 * 256 = 4096`` inside the plane.
"""

from __future__ import annotations

import numpy as np

from ..arith.shard import Slice
from ..arith.tokens import SideTokens
from ..errors import InternalError
from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, PageLayout
from ..values.planes import PlanesLayout
from ..values.request import BlockList

__all__ = ["SideView", "stage_parts"]


def stage_parts(P: EngineGeometry, group: int, d_layers: Slice) -> list[tuple[int, Slice]]:
    """``d_layers`` (a D rank's layers of ``group``) split by the P stage that holds each:
    ``[(P stage, layers)]`` (docs/design.md §11.3). One stage: ``[(0, d_layers)]``."""
    out = []
    for stage in range(P.topology.pp):
        got = P.stage_layers(group, stage).intersect(d_layers)
        if got is not None:
            out.append((stage, got))
    return out


class SideView:
    """One engine's attention group as the planner addresses it: per-layer regions and offsets,
    the page layout's strides, and where a token slot sits inside a page.

    With a per-plane layout (:class:`~kvgeom.values.planes.PlanesLayout`, docs/design.md §3.5) the
    strides and the slot offset depend on the plane, and the listing is cut every
    ``affine_tokens`` tokens so that inside a segment every plane's address is affine (the slot
    offset is the modes' digits times strides; within a segment the inner stride)."""

    def __init__(self, engine: EngineGeometry, group: int, layout: PageLayout | PlanesLayout | None = None) -> None:
        geo = engine.groups[group]
        if not isinstance(geo, AttentionGroupGeometry):
            raise InternalError("checked by the caller")
        self.engine = engine
        self.layout = geo.layout if layout is None else layout
        self.views = geo.views
        self.page_bytes = np.array([r.page_bytes for r in engine.regions], np.int64)

    @property
    def per_plane(self) -> bool:
        """The layout is a :class:`~kvgeom.values.planes.PlanesLayout` (strides depend on the plane)."""
        return isinstance(self.layout, PlanesLayout)

    def plain(self) -> PageLayout:
        """The plain layout (callers that handle only plain layouts; InternalError otherwise)."""
        if not isinstance(self.layout, PageLayout):
            raise InternalError("a per-plane layout where a plain one was checked")
        return self.layout

    def slot_offset(self, slot: np.ndarray, plane: int = 0) -> np.ndarray:
        """Byte offset of token slot ``slot`` inside a page (before head and plane terms)."""
        if isinstance(self.layout, PlanesLayout):
            return self.layout.planes[plane].slot_offset(slot)  # type: ignore[no-any-return]
        return slot * self.layout.token_stride

    def head_offset(self, head: int, plane: int = 0) -> int:
        """Byte offset of local head ``head`` inside a page (the first head a source fills)."""
        return head * self.head_stride(plane)

    def token_stride(self, plane: int = 0) -> int:
        """Bytes between consecutive slots of one segment."""
        if isinstance(self.layout, PlanesLayout):
            return self.layout.planes[plane].token_stride
        return self.layout.token_stride

    def vector_modes(self, plane: int = 0) -> tuple[tuple[int, int], ...]:
        """The head vector's byte modes on ``plane`` (empty: contiguous)."""
        if isinstance(self.layout, PlanesLayout):
            return self.layout.planes[plane].vector_modes
        return ()

    def head_stride(self, plane: int = 0) -> int:
        if isinstance(self.layout, PlanesLayout):
            return self.layout.planes[plane].head_stride
        return self.layout.head_stride

    def planes_share_region(self) -> bool:
        return all(len(set(v.regions)) == 1 for v in self.views)

    def linear(self) -> bool:
        """Token-outermost pages: consecutive pages continue the token stride."""
        if isinstance(self.layout, PlanesLayout):
            return False
        K = self.engine.kernel_block_tokens
        ts = self.layout.token_stride
        regions = {r for v in self.views for r in v.regions}
        return ts > 0 and all(int(self.page_bytes[r]) == K * ts for r in regions)

    def layer_arrays(self, plane: int) -> tuple[np.ndarray, np.ndarray]:
        """(region, offset of plane ``plane`` inside the page) for every layer."""
        reg = np.array([v.regions[plane] for v in self.views], np.int64)
        base = (self.layout.planes[plane].offset if isinstance(self.layout, PlanesLayout)
                else plane * self.layout.kv_stride)
        off = np.array([v.offset + base for v in self.views], np.int64)
        return reg, off

    def cut_tokens(self) -> int:
        """Tokens between two cuts when a per-plane layout's planes are affine over fewer than a
        kernel page (the gcd of their inner extents); 0 otherwise (cut at every kernel page)."""
        K = self.engine.kernel_block_tokens
        if isinstance(self.layout, PlanesLayout) and self.layout.affine_tokens() < K:
            return self.layout.affine_tokens()
        return 0

    def tokens(self, listing: BlockList) -> SideTokens:
        """The listing in kernel terms; a DCP engine's tokens are sharded (docs/design.md §11.2)."""
        e = self.engine
        return SideTokens(np.asarray(listing.block_ids, np.int64), listing.first_token,
                          e.kernel_block_tokens, e.blocks_per_logical, self.linear(), cut_tokens=self.cut_tokens(),
                          cp=e.topology.dcp, interleave=e.topology.interleave)
