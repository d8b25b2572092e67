"""Text and HTML renderings of geometries, requests and plans (no matplotlib here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .geometry import EngineGeometry


def engine_line(e: EngineGeometry) -> str:
    from .geometry import AttentionGroupGeometry

    kinds = []
    for spec, g in zip(e.model.groups, e.groups):
        if isinstance(g, AttentionGroupGeometry):
            lay = g.layout
            order = "HND" if lay.head_stride >= lay.token_stride else "NHD"
            kinds.append(f"{spec.name}:{spec.kind.value}/{order}")
        else:
            kinds.append(f"{spec.name}:state/{g.layout.value}")
    return (f"{e.name}: {e.model.name} TP{e.tp} K={e.kernel_block_tokens} ppl={e.blocks_per_logical} "
            f"(logical {e.logical_block_tokens} tok) [{', '.join(kinds)}] {len(e.regions)} regions")


def engine_repr(e: EngineGeometry) -> str:
    return f"EngineGeometry({engine_line(e)})"


def engine_html(e: EngineGeometry) -> str:
    return f"<pre>{engine_line(e)}</pre>"


def request_repr(r: object) -> str:
    from .request import Request

    assert isinstance(r, Request)  # noqa: S101
    return f"Request(M={r.computed_tokens}, S={r.prefix_hit_tokens}, groups={r.groups!r})"


def request_html(r: object) -> str:
    return f"<pre>{request_repr(r)}</pre>"


def plan_repr(p: object) -> str:
    from .plan import TransferPlan

    assert isinstance(p, TransferPlan)  # noqa: S101
    return (f"TransferPlan(P TP{p.prefill_tp} -> D TP{p.decode_tp}: {len(p.copies)} copies / {p.bytes_copied} B, "
            f"{len(p.zeros)} zeros / {p.bytes_zeroed} B, {len(p.rearranges)} rearranges)")


def plan_html(p: object) -> str:
    return f"<pre>{plan_repr(p)}</pre>"
