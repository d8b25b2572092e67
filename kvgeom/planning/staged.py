"""The staged strategy: P pages land whole inside the D page, then one rearrange per page fixes
the layout in place.

With the direct strategy a layout mismatch multiplies descriptors: HND into NHD gives one per
token per head. Staged copies land in an *arrived* layout instead: D's page dimensions, but P's
order of modes, in sub-pages of ``K_s = min(K_p, K_d)`` tokens, so each P page slice is one run::

    P page (HND, K_p = 4)        [K: h0 t0..3 | h1 t0..3][V: h0 t0..3 | h1 t0..3]
    D page, arrived (K_d = 8)    [ sub 0 = P page 5, HND ][ sub 1 = P page 1, HND ]   2 copies
    (P TP > D TP: inside a sub-page each P rank's heads form one block, so its page lands whole)
    rearrange (per D page)       arrived (sub, kv, head, token) -> D's NHD (kv, token, head)
    zeros                        afterwards, in D's final layout

Worked number: 2 heads x 256 B, K_p = 4, K_d = 8, HND -> NHD, one layer: direct posts
2 planes * 2 heads * 8 tokens = 32 descriptors of 256 B per D page; staged posts 2 descriptors of
2 * 2 * 4 * 256 = 4096 B and one rearrange of 8192 B.

Staged needs the larger kernel page to be a whole number of the smaller one and a dense D page
layout (its strides pack ``planes * heads * K_d * head_bytes`` bytes from the view offset);
otherwise the group falls back to direct and the plan's notes say why. Pipeline stages change
nothing but which layers a D rank permutes (its stage's); DCP token shards break whole-page
landing, so DCP on either side falls back to direct (docs/design.md §11.3).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..arith.tokens import SideTokens, segments
from ..errors import InternalError
from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, PageLayout
from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Rearrange
from ..values.request import BlockList, Request
from .attention import needed_tokens, plan_attention_group
from .group import GroupPlan
from .sides import SideView

__all__ = ["Arrival", "ArrivedView", "arrival", "rearrange_modes", "is_identity", "plan_staged_group",
           "staged_rearrange_shape"]


@attrs.frozen
class Arrival:
    """How bytes land in a D page under the staged strategy (one group, one engine pair)."""

    layout: PageLayout  # arrived strides of (kv, head within a head group, token) in a sub-page
    sub_tokens: int  # K_s = min(K_p, K_d)
    sub_bytes: int  # bytes of one sub-page
    sub_pages: int  # K_d // K_s
    planes_in_page: int  # 2 when D packs K and V in one page, else 1
    group_heads: int  # heads of one source P rank (a head group); all of D's heads when one source
    group_bytes: int  # bytes of one head group inside a sub-page


def _dense(sizes_strides: list[tuple[int, int]], unit: int) -> bool:
    """The modes pack densely from offset 0: sorted by stride, each stride is the product before."""
    expect = unit
    for size, stride in sorted((m for m in sizes_strides if m[0] > 1), key=lambda m: m[1]):
        if stride != expect:
            return False
        expect *= size
    return True


def arrival(P: EngineGeometry, D: EngineGeometry, group: int) -> Arrival | str:
    """The arrived layout for ``group``, or the reason staged does not apply."""
    spec = P.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    Kp, Kd = P.kernel_block_tokens, D.kernel_block_tokens
    if P.topology.dcp > 1 or D.topology.dcp > 1:  # docs/design.md §11.3
        return (f"tokens are sharded over DCP ranks (P dcp={P.topology.dcp}, D dcp={D.topology.dcp}), so a P page "
                "does not land whole inside one D page")
    if max(Kp, Kd) % min(Kp, Kd):
        return f"kernel pages {Kp} and {Kd} tokens do not nest"
    ds, ps = SideView(D, group), SideView(P, group)
    hd, hb = D.local_heads(group), spec.head_bytes
    packed = spec.planes == 2 and ds.planes_share_region()
    planes_in_page = 2 if packed else 1
    dl, pl = ds.layout, ps.layout
    d_modes = [(hd, dl.head_stride), (Kd, dl.token_stride)] + ([(2, dl.kv_stride)] if packed else [])
    if not _dense(d_modes, hb):
        return "D's page layout is not dense, so arrived bytes could not be permuted in place"
    Ks = min(Kp, Kd)
    # When several P ranks fill one D page (P TP > D TP), each P rank's heads form a group that
    # lands as one block: (group, then P's order inside the group).
    hp = P.local_heads(group)
    gh = hp if (not spec.replicated and P.head_tp <= spec.num_kv_heads and hp < hd and hd % hp == 0) else hd
    # P's mode order, innermost first (smallest P stride); K/V in separate P regions: kv outermost
    p_order = sorted(["head", "token"] + (["kv"] if spec.planes == 2 else []),
                     key=lambda m: {"head": pl.head_stride, "token": pl.token_stride,
                                    "kv": pl.kv_stride if pl.kv_stride else 1 << 62}[m])
    size = {"head": gh, "token": Ks, "kv": planes_in_page}
    stride = {"kv": 0}
    cur = hb
    for m in p_order:
        if m == "kv" and not packed:
            continue
        stride[m] = cur
        cur *= size[m]
    return Arrival(PageLayout(kv_stride=stride["kv"], head_stride=stride["head"], token_stride=stride["token"]),
                   Ks, cur * (hd // gh), Kd // Ks, planes_in_page, gh, cur)


class ArrivedView(SideView):
    """D's group addressed through the arrived layout (sub-pages of K_s tokens)."""

    def __init__(self, engine: EngineGeometry, group: int, arr: Arrival) -> None:
        super().__init__(engine, group, arr.layout)
        self.arr = arr

    def slot_offset(self, slot: np.ndarray) -> np.ndarray:
        a = self.arr
        return (slot // a.sub_tokens) * a.sub_bytes + (slot % a.sub_tokens) * a.layout.token_stride

    def head_offset(self, head: int) -> int:
        a = self.arr
        return (head // a.group_heads) * a.group_bytes + (head % a.group_heads) * a.layout.head_stride

    def linear(self) -> bool:
        return False

    def tokens(self, listing: BlockList) -> SideTokens:
        e = self.engine
        return SideTokens(np.asarray(listing.block_ids, np.int64), listing.first_token, e.kernel_block_tokens,
                          e.blocks_per_logical, False, cut_tokens=self.arr.sub_tokens, cp=e.topology.dcp,
                          interleave=e.topology.interleave)


def rearrange_modes(D: EngineGeometry, group: int, arr: Arrival) -> tuple[list[int], list[int], list[int]]:
    """One rearrange's (shape, src strides, dst strides) for every page of ``group``:
    (sub-page, head group, [plane,] head, token), arrived layout -> D's layout."""
    fl = SideView(D, group).layout
    a = arr.layout
    hd = D.local_heads(group)
    shape = [arr.sub_pages, hd // arr.group_heads]
    src = [arr.sub_bytes, arr.group_bytes]
    dst = [arr.sub_tokens * fl.token_stride, arr.group_heads * fl.head_stride]
    if arr.planes_in_page == 2:
        shape.append(2)
        src.append(a.kv_stride)
        dst.append(fl.kv_stride)
    shape += [arr.group_heads, arr.sub_tokens]
    src += [a.head_stride, a.token_stride]
    dst += [fl.head_stride, fl.token_stride]
    return shape, src, dst


def is_identity(shape: list[int], src: list[int], dst: list[int]) -> bool:
    """The permutation moves nothing: every mode of more than one element has equal strides."""
    return all(s == t for n, s, t in zip(shape, src, dst) if n > 1)


def staged_rearrange_shape(D: EngineGeometry, group: int, arr: Arrival) -> dict[str, Any] | None:
    """The rearranges of a staged group without their pages: ``{"rearranges": [keyword arguments of
    each Rearrange but pages]}``, one per (D rank, layer of its stage, plane region); None when the
    permutation is the identity (staged would change nothing)."""
    spec = D.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    shape, src, dst = rearrange_modes(D, group, arr)  # one shape for the whole page
    if is_identity(shape, src, dst):
        return None
    geo = D.groups[group]
    if not isinstance(geo, AttentionGroupGeometry):
        raise InternalError("an attention group has an attention geometry")
    plane_regions = [0] if arr.planes_in_page == 2 or spec.planes == 1 else [0, 1]
    out = []
    for d in range(D.num_ranks):  # each D rank permutes the pages of its own stage's layers
        layers = D.stage_layers(group, D.coords(d).stage)
        for view in geo.views[layers.start:layers.stop]:
            for plane in plane_regions:
                region = view.regions[plane]
                out.append(dict(d_rank=d, d_region=region, shape=tuple(shape), src_strides=tuple(src),
                                dst_strides=tuple(dst), unit_bytes=spec.head_bytes, src_offset=view.offset,
                                dst_offset=view.offset, page_bytes=D.regions[region].page_bytes))
    return {"rearranges": out}


def plan_staged_group(pair: CheckedEngines, request: Request, group: int, *,
                      materialize: bool = True) -> GroupPlan:
    """Staged copies, zeros (final layout), rearranges, notes and the copy rows before coalescing
    of one attention group; falls back to direct (no rearranges) when staging does not apply or
    would change nothing. ``materialize=False`` counts rows and rearranged pages only."""
    spec = pair.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    P, D = pair.prefill, pair.decode
    arr = arrival(P, D, group)
    if isinstance(arr, str):
        return plan_attention_group(pair, request, group, materialize=materialize).with_notes(
            Note(NoteKind.STAGED_NOT_APPLICABLE, f"{spec.name}: staged does not apply ({arr}); direct copies"))
    shape = staged_rearrange_shape(D, group, arr)
    if shape is None:
        return plan_attention_group(pair, request, group, materialize=materialize).with_notes(
            Note(NoteKind.STAGED_EQUALS_DIRECT, f"{spec.name}: arrived layout equals D's layout; staged = direct"))
    landed = plan_attention_group(pair, request, group, landing=ArrivedView(D, group, arr), materialize=materialize)
    g = request.groups[group]
    if not isinstance(g.decode, BlockList):
        raise InternalError("an attention group lists BlockLists (checked by Pair)")
    lo, hi = needed_tokens(request, pair, group)
    # every D page holding a needed token (cut at every page, even where D's pages are token-major)
    per_page = attrs.evolve(SideView(D, group).tokens(g.decode), linear=False)
    touched = np.unique(segments(lo, hi, [per_page]).page[0]) if hi > lo else np.zeros(0, np.int64)
    rearranges: list[Rearrange] = []
    if len(touched):
        pages = tuple(int(p) for p in touched)
        rearranges = [Rearrange(pages=pages, **kw) for kw in shape["rearranges"]]
    moved = sum(r.nbytes_per_page * len(r.pages) for r in rearranges)
    return attrs.evolve(landed.with_notes(Note(
        NoteKind.STAGED, f"{spec.name}: staged: P pages land in sub-pages of {arr.sub_tokens} tokens in P's mode "
        f"order, then {len(rearranges)} rearranges move {moved} B into D's layout")), rearranges=tuple(rearranges))
