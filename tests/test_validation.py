"""Every validation rule: a case that must pass, a neighbouring case that must fail with the typed error.

Each row of ``CASES`` is ``(id, good, bad, error type, path fragment)``: ``good()`` must build,
``bad()`` differs from it in one field and must raise ``error type`` (a ``ValueError``) whose
``path`` contains the fragment, i.e. names the field. Rules come from kvgeom/model.py,
geometry.py, shard.py, request.py, pair.py (``Pair`` and ``Pair.check_request``) and plan.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from kvgeom import (
    AttentionGroupGeometry,
    AttentionSpec,
    AttentionView,
    BlockList,
    Copies,
    EngineGeometry,
    GeometryError,
    GroupRequest,
    IncompatibleGeometry,
    KvGeomError,
    ModelSpec,
    PageLayout,
    Pair,
    PlanError,
    Rearrange,
    Region,
    Request,
    RequestError,
    StateGroupGeometry,
    StateSection,
    StateSlots,
    StateSpec,
    StateView,
    TransferPlan,
    Zeros,
    owned_slice,
)
from kvgeom.arith import check_divisible

# ---- builders -------------------------------------------------------------------------------------


def att(**kw: Any) -> AttentionSpec:
    args: dict[str, Any] = {"name": "attn", "kind": "full", "num_layers": 2, "num_kv_heads": 4, "head_bytes": 64}
    return AttentionSpec(**{**args, **kw})


def sec(**kw: Any) -> StateSection:
    args: dict[str, Any] = {"name": "x", "channels": 8, "unit_bytes": 2, "rows": 3}
    return StateSection(**{**args, **kw})


def state(**kw: Any) -> StateSpec:
    args: dict[str, Any] = {"name": "mamba", "num_layers": 1,
                            "sections": (sec(), sec(name="ssm", rows=1, unit_bytes=32))}
    return StateSpec(**{**args, **kw})


MODEL = ModelSpec("m", (att(),))
HYBRID = ModelSpec("h", (att(num_layers=1), state()))
# one state layer on TP1: x 8 channels x 3 rows x 2 B = 48 B, then ssm 8 x 32 B = 256 B -> 304 B
STATE_BYTES = 8 * 3 * 2 + 8 * 32


def build(model: ModelSpec = MODEL, **kw: Any) -> EngineGeometry:
    args: dict[str, Any] = {"tp": 2, "kernel_block_tokens": 4, "num_blocks": 4, "name": "decode"}
    return EngineGeometry.build(model, **{**args, **kw})


def state_engine(page_bytes: int = STATE_BYTES, *, num_pages: int = 4, ppl: int = 1,
                 views: tuple[StateView, ...] = (StateView(0, 0),), layers: int = 1) -> EngineGeometry:
    model = ModelSpec("s", (state(num_layers=layers),))
    return EngineGeometry(model, tp=1, kernel_block_tokens=4, blocks_per_logical=ppl,
                          regions=(Region(num_pages, page_bytes),),
                          groups=(StateGroupGeometry("channel_major", views),), name="s")


def with_attention(e: EngineGeometry, *, layout: PageLayout | None = None,
                   views: tuple[AttentionView, ...] | None = None) -> EngineGeometry:
    g = e.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    return attrs.evolve(e, groups=(AttentionGroupGeometry(layout or g.layout, views if views is not None else g.views),
                                   *e.groups[1:]))


ENGINE = build()  # TP2, 2 local heads x 4 tokens x 64 B, HND packed: page 2 * 2 * 4 * 64 = 1024 B
PAGE = 2 * 2 * 4 * 64


def pair() -> Pair:
    """P TP1 4-token blocks, D TP2 8-token blocks, 6 logical blocks each."""
    return Pair(build(tp=1, kernel_block_tokens=4, num_blocks=6, name="prefill"),
                build(tp=2, kernel_block_tokens=8, num_blocks=6, name="decode"))


def hybrid_pair() -> Pair:
    return Pair(build(HYBRID, tp=1, num_blocks=6, name="prefill"), build(HYBRID, tp=2, num_blocks=6))


def attn_request(*, m: int = 20, s: int = 0, p: BlockList | None = None, d: BlockList | None = None,
                 partial: bool = False) -> Request:
    return Request(m, (GroupRequest(p or BlockList((0, 1, 2, 3, 4)), d or BlockList((0, 1, 2))),), s,
                   partial=partial)


def hybrid_request(*, p_state: Any = None, d_state: Any = None, p_tokens: int = 20) -> Request:
    return Request(20, (GroupRequest(BlockList((0, 1, 2, 3, 4)), BlockList((0, 1, 2, 3, 4))),
                        GroupRequest(p_state or StateSlots((5,), (p_tokens,)), d_state or StateSlots((5,), (20,)))))


def copies(**kw: Any) -> Copies:
    args: dict[str, Any] = {"p_rank": [0, 1], "p_region": [0, 0], "p_offset": [0, 64], "d_rank": [0, 0],
                            "d_region": [1, 1], "d_offset": [0, 64], "nbytes": [64, 64]}
    return Copies(**{**args, **kw})


def zeros(**kw: Any) -> Zeros:
    args: dict[str, Any] = {"d_rank": [1], "d_region": [0], "d_offset": [128], "nbytes": [32]}
    return Zeros(**{**args, **kw})


def rearrange(**kw: Any) -> Rearrange:
    args: dict[str, Any] = {"d_rank": 0, "d_region": 0, "pages": (1,), "shape": (2, 4), "src_strides": (64, 128),
                            "dst_strides": (256, 64), "unit_bytes": 64, "page_bytes": 1024}
    return Rearrange(**{**args, **kw})


def model_with(**kw: Any) -> ModelSpec:
    args: dict[str, Any] = {"name": "m", "groups": (att(), state()), "dtype": "bfloat16"}
    return ModelSpec(**{**args, **kw})


def engines_of(p_model: ModelSpec, d_model: ModelSpec) -> Pair:
    return Pair(build(p_model, tp=1, name="prefill"), build(d_model, tp=2, kernel_block_tokens=8))


# ---- the table -----------------------------------------------------------------------------------

Case = tuple[str, Callable[[], Any], Callable[[], Any], type[KvGeomError], str]

CASES: list[Case] = [
    # sizes: ints only (never bool or float), numpy ints accepted, lower bounds
    ("layers-zero", lambda: att(num_layers=1), lambda: att(num_layers=0), GeometryError, "AttentionSpec.num_layers"),
    ("layers-bool", lambda: att(num_layers=np.int64(1)), lambda: att(num_layers=True), GeometryError,
     "AttentionSpec.num_layers"),
    ("layers-float", lambda: att(num_layers=2), lambda: att(num_layers=2.0), GeometryError,
     "AttentionSpec.num_layers"),
    ("layers-negative", lambda: att(num_layers=1), lambda: att(num_layers=-1), GeometryError,
     "AttentionSpec.num_layers"),
    ("heads-zero", lambda: att(num_kv_heads=1), lambda: att(num_kv_heads=0), GeometryError,
     "AttentionSpec.num_kv_heads"),
    ("head-bytes-float", lambda: att(head_bytes=64), lambda: att(head_bytes=64.0), GeometryError,
     "AttentionSpec.head_bytes"),
    # attention kinds and windows
    ("kind-unknown", lambda: att(kind="full"), lambda: att(kind="fulll"), GeometryError, "AttentionSpec.kind"),
    ("kind-state", lambda: att(kind="sliding", window_tokens=8), lambda: att(kind="state"), GeometryError,
     "AttentionSpec('attn').kind"),
    ("mla-one-head", lambda: att(kind="mla", num_kv_heads=1), lambda: att(kind="mla", num_kv_heads=2),
     GeometryError, "AttentionSpec('attn').num_kv_heads"),
    ("sliding-needs-window", lambda: att(kind="sliding", window_tokens=8), lambda: att(kind="sliding"),
     GeometryError, "AttentionSpec('attn').window_tokens"),
    ("sliding-window-zero", lambda: att(kind="sliding", window_tokens=1),
     lambda: att(kind="sliding", window_tokens=0), GeometryError, "AttentionSpec('attn').window_tokens"),
    ("full-has-no-window", lambda: att(kind="full"), lambda: att(kind="full", window_tokens=8), GeometryError,
     "AttentionSpec('attn').window_tokens"),
    # state sections, state groups, models
    ("section-channels", lambda: sec(channels=1), lambda: sec(channels=0), GeometryError, "StateSection.channels"),
    ("section-unit-bool", lambda: sec(unit_bytes=1), lambda: sec(unit_bytes=True), GeometryError,
     "StateSection.unit_bytes"),
    ("section-rows", lambda: sec(rows=1), lambda: sec(rows=0), GeometryError, "StateSection.rows"),
    ("state-no-sections", lambda: state(sections=(sec(),)), lambda: state(sections=()), GeometryError,
     "StateSpec('mamba').sections"),
    ("state-section-names", lambda: state(sections=(sec(), sec(name="y"))),
     lambda: state(sections=(sec(), sec())), GeometryError, "StateSpec('mamba').sections"),
    ("state-layers", lambda: state(num_layers=1), lambda: state(num_layers=0), GeometryError,
     "StateSpec.num_layers"),
    ("model-no-groups", lambda: ModelSpec("m", (att(),)), lambda: ModelSpec("m", ()), GeometryError,
     "ModelSpec.groups"),
    ("model-group-type", lambda: ModelSpec("m", (att(),)), lambda: ModelSpec("m", ("attn",)), GeometryError,
     "ModelSpec.groups[0]"),
    ("model-group-names", lambda: ModelSpec("m", (att(), att(name="b"))), lambda: ModelSpec("m", (att(), att())),
     GeometryError, "ModelSpec.groups"),
    ("model-group-index", lambda: MODEL.group_index("attn"), lambda: MODEL.group_index("mla"), GeometryError,
     "group"),
    # TP ownership (shard.py)
    ("rank-range", lambda: owned_slice(8, 4, 3), lambda: owned_slice(8, 4, 4), GeometryError, "rank"),
    ("rank-negative", lambda: owned_slice(8, 4, 0), lambda: owned_slice(8, 4, -1), GeometryError, "rank"),
    ("tp-divides", lambda: owned_slice(8, 4, 0), lambda: owned_slice(8, 3, 0), GeometryError, "tp"),
    ("tp-multiple", lambda: owned_slice(2, 8, 5), lambda: owned_slice(4, 6, 5), GeometryError, "tp"),
    ("divisible-path", lambda: check_divisible("decode.tp", 6, 3), lambda: check_divisible("decode.tp", 6, 4),
     GeometryError, "decode.tp"),
    # regions, layouts, views
    ("region-pages", lambda: Region(1, 8), lambda: Region(0, 8), GeometryError, "Region.num_pages"),
    ("region-page-bytes", lambda: Region(1, 8), lambda: Region(1, -8), GeometryError, "Region.page_bytes"),
    ("layout-negative", lambda: PageLayout(0, 64, 128), lambda: PageLayout(-1, 64, 128), GeometryError,
     "PageLayout.kv_stride"),
    ("layout-float", lambda: PageLayout(0, 64, 128), lambda: PageLayout(0, 64, 128.0), GeometryError,
     "PageLayout.token_stride"),
    ("layout-byte-stride", lambda: PageLayout(0, 64, 128, 1), lambda: PageLayout(0, 64, 128, 2), GeometryError,
     "PageLayout.byte_stride"),
    ("view-offset", lambda: AttentionView((0, 0), 0), lambda: AttentionView((0, 0), -4), GeometryError,
     "AttentionView.offset"),
    ("state-view-region", lambda: StateView(0), lambda: StateView(-1), GeometryError, "StateView.region"),
    ("state-view-offset", lambda: StateView(0, 1), lambda: StateView(0, False), GeometryError, "StateView.offset"),
    ("state-layout-name", lambda: StateGroupGeometry("state_major", ()),
     lambda: StateGroupGeometry("row_major", ()), GeometryError, "StateGroupGeometry.layout"),
    # EngineGeometry.build arguments
    ("build-tp", lambda: build(tp=1), lambda: build(tp=0), GeometryError, "decode.tp"),
    ("build-blocks", lambda: build(num_blocks=1), lambda: build(num_blocks=0), GeometryError, "decode.num_blocks"),
    ("build-kernel-float", lambda: build(kernel_block_tokens=4), lambda: build(kernel_block_tokens=4.0),
     GeometryError, "decode.kernel_block_tokens"),
    ("build-ppl-bool", lambda: build(blocks_per_logical=1), lambda: build(blocks_per_logical=True), GeometryError,
     "decode.blocks_per_logical"),
    ("build-layout-name", lambda: build(layout="NHD"), lambda: build(layout="HDN"), GeometryError, "decode.layout"),
    ("build-kv-name", lambda: build(kv="inner"), lambda: build(kv="interleaved"), GeometryError, "decode.kv"),
    ("build-regions-name", lambda: build(regions="interleaved"), lambda: build(regions="global"), GeometryError,
     "decode.regions"),
    ("build-shared-split", lambda: build(regions="shared", kv="packed"), lambda: build(regions="shared", kv="split"),
     GeometryError, "decode.kv"),
    ("build-tp-heads", lambda: build(tp=8), lambda: build(tp=3), GeometryError, "decode.tp (group 'attn'"),
    ("build-tp-section", lambda: build(HYBRID, tp=4),
     lambda: build(ModelSpec("h", (att(num_layers=1), state(sections=(sec(channels=6),)))), tp=4),
     GeometryError, "section 'x'"),
    ("build-state-major-rows", lambda: build(HYBRID, state_layout="state_major"),
     lambda: build(ModelSpec("h", (att(), state(sections=(sec(), sec(name="y", rows=2))))),
                   state_layout="state_major"),
     GeometryError, "StateSpec('mamba').sections"),
    # EngineGeometry structure
    ("engine-tp", lambda: attrs.evolve(ENGINE, tp=2), lambda: attrs.evolve(ENGINE, tp=0), GeometryError,
     "EngineGeometry.tp"),
    ("engine-group-count", lambda: attrs.evolve(ENGINE, groups=ENGINE.groups),
     lambda: attrs.evolve(ENGINE, groups=()), GeometryError, "decode.groups"),
    ("engine-no-regions", lambda: attrs.evolve(ENGINE, regions=ENGINE.regions),
     lambda: attrs.evolve(ENGINE, regions=()), GeometryError, "decode.regions"),
    ("engine-region-type", lambda: attrs.evolve(ENGINE, regions=(ENGINE.regions[0], Region(4, PAGE))),
     lambda: attrs.evolve(ENGINE, regions=(ENGINE.regions[0], (4, PAGE))), GeometryError, "decode.regions[1]"),
    ("engine-tp-heads", lambda: attrs.evolve(ENGINE, tp=2), lambda: attrs.evolve(ENGINE, tp=3), GeometryError,
     "decode.tp (group 'attn'"),
    ("attention-needs-attention-geometry", lambda: ENGINE,
     lambda: attrs.evolve(ENGINE, groups=(StateGroupGeometry("channel_major", (StateView(0),)),)), GeometryError,
     "decode.groups[0](attn)"),
    ("state-needs-state-geometry", lambda: build(HYBRID),
     lambda: attrs.evolve(build(HYBRID), groups=(build(HYBRID).groups[0], build(HYBRID).groups[0])),
     GeometryError, "decode.groups[1](mamba)"),
    ("attention-view-count", lambda: with_attention(ENGINE, views=ENGINE.groups[0].views),  # type: ignore[union-attr]
     lambda: with_attention(ENGINE, views=ENGINE.groups[0].views[:1]),  # type: ignore[union-attr]
     GeometryError, "decode.groups[0](attn).views"),
    ("attention-view-planes", lambda: with_attention(ENGINE, views=(AttentionView((0, 0)), AttentionView((1, 1)))),
     lambda: with_attention(ENGINE, views=(AttentionView((0,)), AttentionView((1, 1)))), GeometryError,
     "decode.groups[0](attn).views[0].regions"),
    ("attention-region-index", lambda: with_attention(ENGINE, views=(AttentionView((1, 1)), AttentionView((0, 0)))),
     lambda: with_attention(ENGINE, views=(AttentionView((2, 2)), AttentionView((0, 0)))), GeometryError,
     "decode.groups[0](attn).views[0].regions[0]"),
    ("attention-region-type", lambda: with_attention(ENGINE, views=(AttentionView((0, 0)), AttentionView((1, 1)))),
     lambda: with_attention(ENGINE, views=(AttentionView(("0", "0")), AttentionView((1, 1)))), GeometryError,
     "decode.groups[0](attn).views[0].regions[0]"),
    ("attention-past-page-end", lambda: with_attention(ENGINE, views=(AttentionView((0, 0), 0),
                                                                     AttentionView((1, 1)))),
     lambda: with_attention(ENGINE, views=(AttentionView((0, 0), 64), AttentionView((1, 1)))), GeometryError,
     "decode.groups[0](attn).views[0]"),
    ("attention-layers-overlap", lambda: build(regions="interleaved"),
     lambda: with_attention(build(regions="interleaved"), views=(AttentionView((0, 0), 0), AttentionView((0, 0), 0))),
     GeometryError, "decode.groups[0](attn).layout"),
    ("attention-heads-overlap", lambda: with_attention(ENGINE, layout=PageLayout(512, 256, 64)),
     lambda: with_attention(ENGINE, layout=PageLayout(512, 63, 64)), GeometryError,
     "decode.groups[0](attn).layout"),
    ("state-view-count", lambda: state_engine(views=(StateView(0),)), lambda: state_engine(views=()), GeometryError,
     "s.groups[0](mamba).views"),
    ("state-region-index", lambda: state_engine(views=(StateView(0),)), lambda: state_engine(views=(StateView(1),)),
     GeometryError, "s.groups[0](mamba).views[0].region"),
    ("state-pages-whole-logical", lambda: state_engine(num_pages=4, ppl=2, page_bytes=STATE_BYTES // 2),
     lambda: state_engine(num_pages=5, ppl=2, page_bytes=STATE_BYTES // 2), GeometryError,
     "s.regions[0].num_pages"),
    ("state-fits-logical-page", lambda: state_engine(page_bytes=STATE_BYTES),
     lambda: state_engine(page_bytes=STATE_BYTES - 1), GeometryError, "s.groups[0](mamba).views[0]"),
    ("state-fits-with-ppl", lambda: state_engine(page_bytes=STATE_BYTES // 2, ppl=2),
     lambda: state_engine(page_bytes=STATE_BYTES // 2 - 1, ppl=2), GeometryError, "s.groups[0](mamba).views[0]"),
    ("state-layers-overlap",
     lambda: state_engine(page_bytes=2 * STATE_BYTES, layers=2, views=(StateView(0, 0), StateView(0, STATE_BYTES))),
     lambda: state_engine(page_bytes=2 * STATE_BYTES, layers=2,
                          views=(StateView(0, 0), StateView(0, STATE_BYTES - 1))),
     GeometryError, "s.groups[0](mamba).views"),
    ("local-heads-of-state", lambda: build(HYBRID).local_heads(0), lambda: build(HYBRID).local_heads(1),
     GeometryError, "decode.groups[1]"),
    ("state-sections-of-attention", lambda: build(HYBRID).state_sections(1),
     lambda: build(HYBRID).state_sections(0), GeometryError, "decode.groups[0]"),
    # requests on their own
    ("ids-negative", lambda: BlockList((1, 2)), lambda: BlockList((1, -2)), RequestError, "BlockList.block_ids[1]"),
    ("ids-bool", lambda: BlockList((1, 2)), lambda: BlockList((1, True)), RequestError, "BlockList.block_ids[1]"),
    ("ids-float", lambda: BlockList((1, np.int32(2))), lambda: BlockList((1, 2.0)), RequestError,
     "BlockList.block_ids[1]"),
    ("ids-duplicate", lambda: BlockList((1, 2)), lambda: BlockList((1, 1)), RequestError, "BlockList.block_ids"),
    ("first-token-negative", lambda: BlockList((1,), 0), lambda: BlockList((1,), -8), RequestError,
     "BlockList.first_token"),
    ("slots-duplicate", lambda: StateSlots((1, 2), (4, 8)), lambda: StateSlots((1, 1), (4, 8)), RequestError,
     "StateSlots.slot_ids"),
    ("slots-token-count", lambda: StateSlots((1,), (4,)), lambda: StateSlots((1,), (4, 8)), RequestError,
     "StateSlots.tokens"),
    ("slots-token-negative", lambda: StateSlots((1,), (0,)), lambda: StateSlots((1,), (-1,)), RequestError,
     "StateSlots.tokens[0]"),
    ("slots-same-position", lambda: StateSlots((1, 2), (4, 8)), lambda: StateSlots((1, 2), (4, 4)), RequestError,
     "StateSlots.tokens"),
    ("group-request-kinds", lambda: GroupRequest(BlockList((1,)), BlockList((2,))),
     lambda: GroupRequest(BlockList((1,)), StateSlots((2,), (4,))), RequestError, "GroupRequest"),
    ("request-m-negative", lambda: Request(0, ()), lambda: Request(-1, ()), RequestError, "Request.computed_tokens"),
    ("request-m-float", lambda: Request(4, ()), lambda: Request(4.0, ()), RequestError, "Request.computed_tokens"),
    ("request-s-negative", lambda: Request(4, (), 0), lambda: Request(4, (), -4), RequestError,
     "Request.prefix_hit_tokens"),
    ("request-s-exceeds-m", lambda: Request(4, (), 4), lambda: Request(4, (), 8), RequestError,
     "Request.prefix_hit_tokens"),
    ("request-group-type", lambda: Request(4, (GroupRequest(BlockList((1,)), BlockList((1,))),)),
     lambda: Request(4, (BlockList((1,)),)), RequestError, "Request.groups[0]"),
    # a request against a pair (Pair.check_request)
    ("check-group-count", lambda: pair().check_request(attn_request()),
     lambda: pair().check_request(Request(20, ())), RequestError, "Request.groups"),
    ("check-prefix-on-d-boundary", lambda: pair().check_request(attn_request(s=8, d=BlockList((1, 2), 8))),
     lambda: pair().check_request(attn_request(s=4, d=BlockList((1, 2), 0))), RequestError,
     "Request.prefix_hit_tokens"),
    # P listing from token 4 does not cover [0, 20): a partial transfer on purpose, so only the boundary rule applies
    ("check-first-token-boundary", lambda: pair().check_request(attn_request(p=BlockList((0, 1), 4), partial=True)),
     lambda: pair().check_request(attn_request(p=BlockList((0, 1), 2), partial=True)), RequestError,
     "Request.groups[0](attn).prefill.first_token"),
    ("check-attention-listing", lambda: pair().check_request(attn_request()),
     lambda: pair().check_request(Request(20, (GroupRequest(StateSlots((0,), (20,)), StateSlots((0,), (20,))),))),
     RequestError, "Request.groups[0](attn).prefill"),
    ("check-block-id-range", lambda: pair().check_request(attn_request(d=BlockList((5, 1, 2)))),
     lambda: pair().check_request(attn_request(d=BlockList((6, 1, 2)))), RequestError,
     "Request.groups[0](attn).decode.block_ids"),
    ("check-state-listing", lambda: hybrid_pair().check_request(hybrid_request()),
     lambda: hybrid_pair().check_request(hybrid_request(p_state=BlockList((5,)), d_state=BlockList((5,)))),
     RequestError,
     "Request.groups[1](mamba).prefill"),
    ("check-state-tokens-computed", lambda: hybrid_pair().check_request(hybrid_request(p_tokens=20)),
     lambda: hybrid_pair().check_request(hybrid_request(p_tokens=21)), RequestError,
     "Request.groups[1](mamba).prefill.tokens"),
    ("check-slot-range", lambda: hybrid_pair().check_request(hybrid_request(p_state=StateSlots((5,), (20,)))),
     lambda: hybrid_pair().check_request(hybrid_request(p_state=StateSlots((6,), (20,)))), RequestError,
     "Request.groups[1](mamba).prefill.block_ids"),
    # pairing two engines (Pair)
    ("pair-dtype", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(dtype="fp8")), IncompatibleGeometry, "decode.model.dtype"),
    ("pair-group-missing", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(),))), IncompatibleGeometry, "decode.model.groups"),
    ("pair-group-order", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(state(), att()))), IncompatibleGeometry,
     "decode.model.groups"),
    ("pair-group-kind", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(), att(name="mamba")))), IncompatibleGeometry,
     "decode.model.groups[1](mamba).kind"),
    ("pair-attention-kind", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(kind="sliding", window_tokens=8), state()))),
     IncompatibleGeometry, "decode.model.groups[0](attn).kind"),
    ("pair-layers", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(num_layers=3), state()))), IncompatibleGeometry,
     "decode.model.groups[0](attn).num_layers"),
    ("pair-heads", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(num_kv_heads=8), state()))), IncompatibleGeometry,
     "decode.model.groups[0](attn).num_kv_heads"),
    ("pair-head-bytes", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(head_bytes=32), state()))), IncompatibleGeometry,
     "decode.model.groups[0](attn).head_bytes"),
    ("pair-window", lambda: engines_of(model_with(groups=(att(kind="sliding", window_tokens=8), state())),
                                       model_with(groups=(att(kind="sliding", window_tokens=8), state()))),
     lambda: engines_of(model_with(groups=(att(kind="sliding", window_tokens=8), state())),
                        model_with(groups=(att(kind="sliding", window_tokens=16), state()))),
     IncompatibleGeometry, "decode.model.groups[0](attn).window_tokens"),
    ("pair-state-layers", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(groups=(att(), state(num_layers=2))), model_with()), IncompatibleGeometry,
     "decode.model.groups[1](mamba).num_layers"),
    ("pair-state-sections", lambda: engines_of(model_with(), model_with()),
     lambda: engines_of(model_with(), model_with(groups=(att(), state(sections=(sec(unit_bytes=4),))))),
     IncompatibleGeometry, "decode.model.groups[1](mamba).sections"),
    # the plan container
    ("copies-columns", lambda: copies(), lambda: copies(p_rank=[[0, 1]]), PlanError, "p_rank"),
    ("copies-float", lambda: copies(p_offset=np.array([0, 64], np.uint32)),
     lambda: copies(p_offset=[0.0, 64.0]), PlanError, "p_offset"),
    ("copies-bool", lambda: copies(d_rank=[0, 1]), lambda: copies(d_rank=[False, True]), PlanError, "d_rank"),
    ("copies-lengths", lambda: copies(), lambda: copies(d_offset=[0]), PlanError, "Copies.d_offset"),
    ("copies-negative", lambda: copies(), lambda: copies(p_offset=[0, -64]), PlanError, "Copies.p_offset"),
    ("copies-empty-row", lambda: copies(nbytes=[1, 64]), lambda: copies(nbytes=[0, 64]), PlanError,
     "Copies.nbytes"),
    ("zeros-negative", lambda: zeros(), lambda: zeros(d_offset=[-1]), PlanError, "Zeros.d_offset"),
    ("zeros-lengths", lambda: zeros(), lambda: zeros(nbytes=[32, 32]), PlanError, "Zeros.nbytes"),
    ("rearrange-shape", lambda: rearrange(), lambda: rearrange(dst_strides=(256,)), PlanError, "Rearrange.shape"),
    ("rearrange-page-bytes", lambda: rearrange(), lambda: rearrange(page_bytes=0), PlanError,
     "Rearrange.page_bytes"),
    ("rearrange-inside-page", lambda: rearrange(dst_offset=1024 - 512), lambda: rearrange(dst_offset=1024 - 512 + 1), PlanError,
     "Rearrange.dst_strides"),
    ("rearrange-unit", lambda: rearrange(), lambda: rearrange(unit_bytes=0), PlanError, "Rearrange.unit_bytes"),
    ("rearrange-pages", lambda: rearrange(), lambda: rearrange(pages=(-1,)), PlanError, "Rearrange.pages[0]"),
    ("plan-p-rank", lambda: TransferPlan(2, 1, copies(), Zeros.empty()),
     lambda: TransferPlan(1, 1, copies(), Zeros.empty()), PlanError, "TransferPlan.copies.p_rank"),
    ("plan-d-rank", lambda: TransferPlan(2, 1, copies(), Zeros.empty()),
     lambda: TransferPlan(2, 1, copies(d_rank=[0, 1]), Zeros.empty()), PlanError, "TransferPlan.copies.d_rank"),
    ("plan-zero-rank", lambda: TransferPlan(2, 2, copies(), zeros()),
     lambda: TransferPlan(2, 1, copies(), zeros()), PlanError, "TransferPlan.zeros.d_rank"),
]


@pytest.mark.parametrize(("good", "bad", "error", "path"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(good: Callable[[], Any], bad: Callable[[], Any], error: type[KvGeomError], path: str) -> None:
    good()
    with pytest.raises(error) as info:
        bad()
    err = info.value
    assert isinstance(err, ValueError)
    assert path in err.path, f"path {err.path!r} does not name {path!r}"
    assert str(err).startswith(f"{err.path}: ")  # one line that leads with the field


def test_case_ids_are_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


def test_errors_carry_values_and_fix() -> None:
    with pytest.raises(GeometryError) as info:
        build(tp=3)
    err = info.value
    assert err.actual == (4, 3) and err.fix and "fix:" in str(err)
    with pytest.raises(RequestError) as rinfo:
        pair().check_request(attn_request(d=BlockList((6, 1, 2))))
    assert rinfo.value.actual == 6 and rinfo.value.expected == "0 <= id < 6"


def test_section_replicated_must_be_bool() -> None:
    sec(replicated=True)
    with pytest.raises(GeometryError) as info:
        sec(replicated=1)
    assert "StateSection.replicated" in info.value.path


def test_state_section_type() -> None:
    state(sections=(sec(),))
    with pytest.raises(GeometryError) as info:
        state(sections=("x",))
    assert "StateSpec('mamba').sections[0]" in info.value.path


@pytest.mark.parametrize(("make", "error", "path"), [
    (lambda: ModelSpec("m", None), GeometryError, "ModelSpec.groups"),
    (lambda: BlockList(None), RequestError, "BlockList.block_ids"),
    (lambda: StateSlots(5, (1,)), RequestError, "StateSlots.slot_ids"),
    (lambda: Request(4, None), RequestError, "Request.groups"),
    (lambda: Pair(1, 2), IncompatibleGeometry, "Pair.prefill"),
    (lambda: TransferPlan(0, 1, Copies.empty(), Zeros.empty()), PlanError, "TransferPlan.prefill_tp"),
    (lambda: TransferPlan(True, 1, Copies.empty(), Zeros.empty()), PlanError, "TransferPlan.prefill_tp"),
    (lambda: owned_slice(0, 2, 0), GeometryError, "owned_slice"),
])
def test_wrong_types_and_empty_axes_raise_typed_errors(make: Callable[[], Any], error: type[KvGeomError],
                                                       path: str) -> None:
    with pytest.raises(error) as info:
        make()
    assert info.value.path == path


def test_address_functions_check_their_indices() -> None:
    m = ModelSpec("g", [AttentionSpec("a", "full", 1, 2, 8), StateSpec("s", 1, [StateSection("x", 2, 2)])])
    e = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2, regions="shared", name="decode")
    region, offset = e.attention_address(0, 0, 1, 1, 3, 1)
    assert offset == 1 * e.regions[0].page_bytes + 1 * (2 * 4 * 8) + 1 * (4 * 8) + 3 * 8  # page, V, head 1, slot 3
    for call, path in [(lambda: e.attention_address(0, 1, 0, 0, 0, 0), "decode.layer"),
                       (lambda: e.attention_address(0, 0, 2, 0, 0, 0), "decode.plane"),
                       (lambda: e.attention_address(1, 0, 0, 0, 0, 0), "decode.groups[1]"),
                       (lambda: e.state_address(1, 0, 1, 0, 0, 0), "decode.section"),
                       (lambda: e.state_address(5, 0, 0, 0, 0, 0), "decode.group"),
                       (lambda: e.local_heads(7), "decode.group")]:
        with pytest.raises(GeometryError) as info:
            call()
        assert info.value.path == path


def test_hostile_sizes_are_refused_by_arithmetic_before_anything_is_enumerated() -> None:
    """A remote's self-description is untrusted: absurd sizes raise typed errors at once (no
    allocation proportional to the claimed sizes)."""
    from kvgeom.values import MAX_PAGE_VECTORS

    m = ModelSpec("g", [AttentionSpec("a", "full", 1, 2, 8)])
    with pytest.raises(GeometryError) as info:
        PageLayout(0, 2**70, 8)
    assert info.value.path == "PageLayout.head_stride"
    lay = PageLayout(kv_stride=2 * 8, head_stride=8, token_stride=0)
    # 10**12 tokens per page claimed, 64 B pages: the span check refuses it without a meshgrid
    with pytest.raises(GeometryError) as info:
        EngineGeometry(m, 1, 10**12, 1, [Region(4, 64)], [AttentionGroupGeometry(
            PageLayout(kv_stride=32, head_stride=16, token_stride=8), [AttentionView((0, 0))])], name="remote")
    assert info.value.path == "remote.groups[0](a).views[0]"
    # a page big enough for the claim: refused by the enumeration limit, still before enumerating
    K = MAX_PAGE_VECTORS  # 2 planes x 2 heads x K vectors > the limit
    with pytest.raises(GeometryError) as info:
        EngineGeometry(m, 1, K, 1, [Region(1, 4 * 8)], [AttentionGroupGeometry(lay, [AttentionView((0, 0))])],
                       name="remote")
    assert info.value.path == "remote.groups[0](a)"
