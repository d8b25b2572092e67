"""One KV-cache group read from its layers' tensors (docs/design.md §10.1): per attention layer the
kernel page tokens, heads, head bytes, planes and the head, token and kv strides, checked equal
over the group and turned into a page layout and views; per state layer the sections' offsets,
channel and row strides, turned into a state layout and placements; and the check that no two
layers' bytes overlap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from ..arith.shard import local_count
from ..errors import GeometryError, value_text
from .axes import LayerTensors, _read_axes
from .engine_checks import MAX_PAGE_VECTORS
from .fields import check_instance, check_int, check_str
from .layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    PageLayout,
    StateGroupGeometry,
    StateLayout,
    StateView,
    section_placements,
    state_layout,
)
from .model import AttentionSpec, ModelSpec, StateSpec
from .planes import PlaneLayout, PlanesLayout, contiguous_bytes, mode_offsets
from .strided import tensor_facts
from .tensor_regions import _Candidate

MAX_SIZES = 64  # entries of from_tensors' sizes=


def _label(entry: LayerTensors, group: str, layer: int) -> str:
    return entry.name or f"{group}[{layer}]"


@attrs.frozen
class _AttnLayer:
    label: str
    K: int
    heads: int
    head_bytes: int
    planes: int
    head_stride: int
    token_stride: int
    kv_in_page: int | None  # kv stride when K and V sit in one page of one tensor
    kv_axis: int | None  # the kv axis' stride when the description names one
    # per plane (head stride, token modes, byte modes) when the planes differ, a head vector is split in
    # byte modes or the token axis in parts (docs/design.md §3.5); None: one PageLayout says it
    per_plane: tuple[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...] | None = None


@attrs.frozen
class _StateLayer:
    label: str
    # section name -> (candidate key, byte offset in its tensor, channel stride, row stride, local channels)
    sections: dict[str, tuple[tuple[Any, ...], int, int, int, int]]


# ---- attention -------------------------------------------------------------------------------------

def _sizes(value: Any, path: str) -> dict[str, int]:
    """``sizes=``: axis name -> size, at most ``MAX_SIZES`` entries, each size an int >= 1."""
    if value is None:
        return {}
    check_instance(path, value, Mapping, fix='pass a dict such as {"token": 16}')
    if len(value) > MAX_SIZES:
        raise GeometryError(path, f"{len(value)} entries exceed the {MAX_SIZES} kvgeom accepts", actual=len(value),
                            expected=f"<= {MAX_SIZES} entries", fix="give the sizes of composite axes only")
    out: dict[str, int] = {}
    for key, size in value.items():
        check_str(f"{path} key", key)
        out[key] = check_int(f"{path}[{value_text(key, 40)}]", size, minimum=1)
    return out


def _attention_group(gi: int, spec: AttentionSpec, entries: list[LayerTensors], tp: int, sizes: Mapping[str, int],
                     cands: list[_Candidate], name: str) -> list[_AttnLayer]:
    out: list[_AttnLayer] = []
    allowed = ("page", "token", "head", "kv", "layer")
    heads = local_count(spec.num_kv_heads, tp, replicated=spec.replicated)
    layer = 0
    for entry in entries:
        if not isinstance(entry.axes, str):
            raise GeometryError(f"{name}.{_label(entry, spec.name, layer)}.axes", "an attention layer's axes are one "
                                "string", actual=entry.axes, fix='e.g. "page kv token head dim"')
        tensors = entry.tensors
        pair = isinstance(tensors, (tuple, list))
        if pair and len(tensors) != 2:
            raise GeometryError(f"{name}.{_label(entry, spec.name, layer)}.tensors", f"{len(tensors)} tensors; "
                                "give one tensor or a (k, v) pair", actual=len(tensors), expected="1 or 2")
        given = list(tensors) if pair else [tensors]
        facts = [tensor_facts(t, f"{name}.{_label(entry, spec.name, layer)}.tensors[{i}]") for i, t in
                 enumerate(given)]
        # split head vectors only from (k, v) pairs (per-plane views, docs/design.md §3.5): one tensor keeps
        # the contiguity check, which catches a description with two axes swapped
        axes = [_read_axes(f, entry.axes, sizes, f"{name}.{_label(entry, spec.name, layer)}", allowed,
                           split_vectors=pair) for f in facts]
        first = axes[0]
        n_layers = first.named.get("layer", (1, 0))[0]
        if "layer" in first.named and (len(entries) != 1 or n_layers != spec.num_layers):
            raise GeometryError(f"{name}.{_label(entry, spec.name, layer)}.layer", f"a layer axis of {n_layers} "
                                f"in one of {len(entries)} entries for a group of {spec.num_layers} layers",
                                actual=n_layers, expected=spec.num_layers,
                                fix="one entry with a layer axis covering every layer, or one entry per layer")
        for sub in range(n_layers):
            label = _label(entry, spec.name, layer) if n_layers == 1 else f"{entry.name or spec.name}[{layer}]"
            path = f"{name}.{label}"
            for ax in axes:
                for need in ("page", "token"):
                    if need not in ax.named:
                        raise GeometryError(f"{path}.{need}", f"no {need!r} axis in {entry.axes!r}",
                                            actual=entry.axes, fix=f"name the {need} axis")
            planes_here = first.named["kv"][0] if "kv" in first.named else (2 if pair else 1)
            if pair and "kv" in first.named:
                raise GeometryError(f"{path}.kv", "two tensors (k, v) and a kv axis", actual=entry.axes,
                                    fix="drop the kv axis when K and V are separate tensors")
            if planes_here != spec.planes:
                raise GeometryError(f"{path}.kv", f"{planes_here} plane(s) for a {spec.kind.value} group of "
                                    f"{spec.planes}", actual=planes_here, expected=spec.planes,
                                    fix="K and V: a kv axis of 2 or a (k, v) pair; MLA: one tensor, no kv axis")
            K = first.named["token"][0]
            h = first.named.get("head", (1, 0))[0]
            if h != heads:
                raise GeometryError(f"{path}.head", f"{h} heads per rank, the model has {spec.num_kv_heads} KV "
                                    f"heads over tp={tp}: {heads} per rank", actual=h, expected=heads,
                                    fix="check the model's KV heads and the engine's TP")
            if first.element_bytes != spec.head_bytes:
                raise GeometryError(f"{path}.{first.element_name}", f"head vectors of {first.element_bytes} B, the "
                                    f"model says {spec.head_bytes} B", actual=first.element_bytes,
                                    expected=spec.head_bytes, fix="check the head size and the cache dtype")
            for ax in axes[1:]:  # K and V may differ in their token, head and byte strides (a per-plane layout)
                same_sizes = {k: v[0] for k, v in ax.named.items()} == {k: v[0] for k, v in first.named.items()}
                if not same_sizes or ax.named["page"] != first.named["page"] or ax.element_bytes != first.element_bytes:
                    raise GeometryError(f"{path}.tensors[1]", "K and V tensors differ in shape or page stride",
                                        actual=ax.named, expected=first.named, fix="pass the two planes of one layer")
            plane_axes = axes if pair else axes * planes_here
            per_plane: tuple[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...] | None = tuple(
                (ax.named["head"][1] if "head" in ax.named else 0, ax.token_modes, ax.vector_modes)
                for ax in plane_axes)
            if per_plane is not None and len(set(per_plane)) == 1 and not per_plane[0][2] and len(per_plane[0][1]) == 1:
                per_plane = None  # one stride per axis, contiguous vectors: a PageLayout (as before §3.5)
            ps = first.named["page"][1]
            P = first.named["page"][0]
            hs = first.named["head"][1] if "head" in first.named else 0
            ts = first.named["token"][1]
            kvs = first.named["kv"][1] if "kv" in first.named else 0
            layer_off = sub * first.named["layer"][1] if "layer" in first.named else 0
            in_page = (h - 1) * hs + (K - 1) * ts + spec.head_bytes
            if per_plane is not None:
                in_page = max((h - 1) * p_hs + _token_span(p_tm) + _vector_span(vm, spec.head_bytes)
                              for p_hs, p_tm, vm in per_plane)
            kv_in_page = None
            if "kv" in first.named and planes_here > 1 and kvs < ps:
                kv_in_page = kvs
                in_page += (planes_here - 1) * kvs
            if ps < in_page or ps == 0:
                raise GeometryError(f"{path}.page", f"a page stride of {ps} B is smaller than the page it holds "
                                    f"({in_page} B: {h} heads x {K} tokens x {spec.head_bytes} B"
                                    f"{' x 2 planes' if kv_in_page is not None else ''})", actual=ps,
                                    expected=f">= {in_page}", fix="check the axis order of the description")
            for plane in range(spec.planes):
                f = facts[plane] if pair else facts[0]
                addr = f.address + layer_off + (plane * kvs if not pair else 0)
                span = (h - 1) * hs + (K - 1) * ts + spec.head_bytes
                if per_plane is not None:
                    p_hs, p_tm, vm = per_plane[plane]
                    span = (h - 1) * p_hs + _token_span(p_tm) + _vector_span(vm, spec.head_bytes)
                if kv_in_page is not None and plane:  # K's candidate spans both planes; V needs no candidate
                    continue
                if kv_in_page is not None:
                    span += (planes_here - 1) * kvs
                cands.append(_Candidate(("attn", gi, layer, plane), label, addr, ps, P, span, f.allocation, False))
            out.append(_AttnLayer(label, K, h, spec.head_bytes, spec.planes, hs, ts, kv_in_page,
                                  kvs if "kv" in first.named else None, per_plane))
            layer += 1
    if layer != spec.num_layers:
        raise GeometryError(f"{name}.layers", f"{layer} layer(s) given for group {spec.name!r} of "
                            f"{spec.num_layers}", actual=layer, expected=spec.num_layers,
                            fix="give one LayerTensors per layer of every group, in order")
    return out


def _token_span(modes: tuple[tuple[int, int], ...]) -> int:
    """Bytes from the first slot's start to the last slot's start."""
    return sum((e - 1) * s for e, s in modes)


def _vector_span(modes: tuple[tuple[int, int], ...], head_bytes: int) -> int:
    """Bytes from a head vector's first byte to its last, plus one."""
    return 1 + sum((e - 1) * s for e, s in modes) if modes else head_bytes


def _kernel_tokens(attn: dict[int, list[_AttnLayer]], given: int | None, name: str) -> int:
    """The one kernel page size every attention layer shows (the first layer's; another is named)."""
    ordered = [lay for layers in attn.values() for lay in layers]
    for lay in ordered[1:]:
        if lay.K != ordered[0].K:
            raise GeometryError(f"{name}.{lay.label}.token", f"{lay.K} tokens per page, but {ordered[0].label} has "
                                f"{ordered[0].K}: one kernel page size per engine", actual=lay.K,
                                expected=ordered[0].K, fix="check the token axes")
    if ordered:
        if given is not None and given != ordered[0].K:
            raise GeometryError(f"{name}.kernel_block_tokens", f"{given} given, the tensors hold {ordered[0].K} "
                                "tokens per page", actual=given, expected=ordered[0].K,
                                fix="drop the argument or fix it")
        return ordered[0].K
    if given is None:
        raise GeometryError(f"{name}.kernel_block_tokens", "no attention group shows the kernel page size",
                            expected="int >= 1", fix="pass kernel_block_tokens=")
    return given


def _attention_geometry(gi: int, spec: AttentionSpec, layers: list[_AttnLayer],
                        placed: dict[tuple[Any, ...], tuple[int, int]], K: int, name: str) -> AttentionGroupGeometry:
    views: list[AttentionView] = []
    layouts: list[tuple[str, PageLayout | PlanesLayout]] = []
    for li, lay in enumerate(layers):
        r0, o0 = placed[("attn", gi, li, 0)]
        h = lay.heads
        # a missing head axis (one head) and a missing kv axis (one plane) take the strides a dense
        # head-major page gives them (EngineGeometry.build's HND), so MLA tensors read as the builder's
        head_stride = lay.head_stride if h > 1 or lay.head_stride else K * lay.token_stride
        if spec.planes == 1:
            kv_stride = lay.kv_axis if lay.kv_axis is not None else h * head_stride
            regions: tuple[int, ...] = (r0,)
        elif lay.kv_in_page is not None:
            kv_stride, regions = lay.kv_in_page, (r0, r0)
        else:
            r1, o1 = placed[("attn", gi, li, 1)]
            if r1 == r0:
                if o1 <= o0:
                    raise GeometryError(f"{name}.{lay.label}.kv", f"V starts at byte {o1} of its page, before K "
                                        f"at {o0}", actual=(o0, o1), expected="K before V",
                                        fix="pass (k, v) in that order")
                kv_stride, regions = o1 - o0, (r0, r0)
            else:
                if o1 != o0:
                    raise GeometryError(f"{name}.{lay.label}.kv", f"K sits at byte {o0} of its pages (region {r0}), "
                                        f"V at byte {o1} (region {r1}): one layer has one offset in its pages",
                                        actual=(o0, o1), expected="equal offsets",
                                        fix="register K and V buffers that start at the same page offset")
                kv_stride, regions = 0, (r0, r1)
        if lay.per_plane is not None:  # docs/design.md §3.5: a layout per plane
            offsets = [0, kv_stride] if spec.planes == 2 and regions[0] == regions[-1] else [0] * spec.planes
            layouts.append((lay.label, PlanesLayout(tuple(
                PlaneLayout(off, p_hs if h > 1 or p_hs else K * p_tm[0][1], p_tm, vm)
                for off, (p_hs, p_tm, vm) in zip(offsets, lay.per_plane)))))
        else:
            layouts.append((lay.label, PageLayout(kv_stride=kv_stride, head_stride=head_stride,
                                                  token_stride=lay.token_stride)))
        views.append(AttentionView(regions, o0))
    if not layouts:
        raise GeometryError(f"{name}.layers", f"no layer of group {spec.name!r}", fix="give its tensors")
    first_label, layout = layouts[0]
    for label, other in layouts[1:]:
        if other != layout:
            raise GeometryError(f"{name}.{label}", f"page layout {attrs.asdict(other)} differs from "
                                f"{first_label}'s {attrs.asdict(layout)}: one group has one page layout",
                                actual=attrs.asdict(other), expected=attrs.asdict(layout),
                                fix="give every layer of a group the same axis order and strides")
    return AttentionGroupGeometry(layout, tuple(views))


# ---- state -----------------------------------------------------------------------------------------

def _state_group(gi: int, spec: StateSpec, entries: list[LayerTensors], tp: int, sizes: Mapping[str, int],
                 cands: list[_Candidate], name: str) -> list[_StateLayer]:
    out: list[_StateLayer] = []
    if len(entries) != spec.num_layers:
        raise GeometryError(f"{name}.layers", f"{len(entries)} layer(s) given for state group {spec.name!r} of "
                            f"{spec.num_layers}", actual=len(entries), expected=spec.num_layers,
                            fix="give one LayerTensors per layer, in order")
    local = {s.name: local_count(s.channels, tp, replicated=s.replicated) for s in spec.sections}
    by_name = {s.name: s for s in spec.sections}
    for li, entry in enumerate(entries):
        label = _label(entry, spec.name, li)
        path = f"{name}.{label}"
        if not isinstance(entry.tensors, Mapping):
            raise GeometryError(f"{path}.tensors", "a state layer's tensors map section names to tensors",
                                actual=type(entry.tensors).__name__, expected='{"x B C": conv, "ssm": ssm}',
                                fix="key each tensor by the sections it holds, in channel order")
        if len(entry.tensors) > len(spec.sections):
            raise GeometryError(f"{path}.tensors", f"{len(entry.tensors)} tensors for {len(spec.sections)} sections",
                                actual=len(entry.tensors), expected=f"<= {len(spec.sections)}",
                                fix="key each tensor by the sections it holds")
        covered: list[str] = []
        sections: dict[str, tuple[tuple[Any, ...], int, int, int, int]] = {}
        for key, tensor in entry.tensors.items():
            names = check_str(f"{path}.tensors key", key).split()
            for s in names:
                if s not in by_name:
                    raise GeometryError(f"{path}.tensors[{key!r}]", f"no section {s!r} in group {spec.name!r}",
                                        actual=s, expected=list(by_name), fix="use the model's section names")
            covered += names
            if isinstance(entry.axes, Mapping) and key not in entry.axes:
                raise GeometryError(f"{path}.axes", f"no axis description for {value_text(key, 60)}",
                                    actual=value_text(list(entry.axes), 120), expected=f"a key {value_text(key, 60)}",
                                    fix="give axes the same keys as tensors, or one string")
            text = entry.axes[key] if isinstance(entry.axes, Mapping) else entry.axes
            tpath = f"{path}[{key}]"
            facts = tensor_facts(tensor, f"{tpath}.tensor")
            ax = _read_axes(facts, text, sizes, tpath, ("page", "channel", "row"))
            if "page" not in ax.named:
                raise GeometryError(f"{tpath}.page", f"no page axis in {value_text(text, 80)}", actual=text,
                                    fix="name the slot (logical block) axis page")
            ch_total = sum(local[s] for s in names)
            n_ch, ch_stride = ax.named.get("channel", (1, 0))
            rows, row_stride = ax.named.get("row", (1, 0))
            if n_ch != ch_total:
                raise GeometryError(f"{tpath}.channel", f"{n_ch} channels per rank for sections {names}, the model "
                                    f"has {ch_total} over tp={tp}", actual=n_ch, expected=ch_total,
                                    fix="check the section channel counts and the engine's TP")
            P, ps = ax.named["page"]
            span = (n_ch - 1) * ch_stride + (rows - 1) * row_stride + ax.element_bytes
            if ps < span:
                raise GeometryError(f"{tpath}.page", f"a page stride of {ps} B is smaller than the state it holds "
                                    f"({span} B)", actual=ps, expected=f">= {span}",
                                    fix="check the axis order of the description")
            key_t = ("state", gi, li, len(cands))
            cands.append(_Candidate(key_t, label, facts.address, ps, P, span, facts.allocation, True))
            ch0 = 0
            for s in names:
                sec = by_name[s]
                if sec.rows != rows:
                    raise GeometryError(f"{tpath}.row", f"{rows} rows, section {s!r} has {sec.rows}", actual=rows,
                                        expected=sec.rows, fix="describe the row axis (conv: kernel - 1)")
                if sec.unit_bytes != ax.element_bytes:
                    raise GeometryError(f"{tpath}.{ax.element_name}", f"units of {ax.element_bytes} B, section "
                                        f"{s!r} has {sec.unit_bytes} B", actual=ax.element_bytes,
                                        expected=sec.unit_bytes, fix="check the element axes and the dtype")
                sections[s] = (key_t, ch0 * ch_stride, ch_stride, row_stride, local[s])
                ch0 += local[s]
        missing = [s for s in by_name if s not in covered]
        twice = sorted({s for s in covered if covered.count(s) > 1})
        if missing or twice:
            raise GeometryError(f"{path}.tensors", f"sections missing {missing} / given twice {twice}",
                                actual=covered, expected=list(by_name), fix="cover every section exactly once")
        out.append(_StateLayer(label, sections))
    return out


def _placement_problem(spec: StateSpec, layout: StateLayout, tp: int, lay: _StateLayer,
                       offsets: dict[str, int]) -> tuple[str, int]:
    """("", view offset) when ``layout`` places every section where the tensors have it, else (why, 0)."""
    try:
        places = {p.name: p for p in section_placements(spec, layout, tp)}
    except GeometryError as e:  # state_major with several multi-row counts
        return f"{layout.value}: {e.message}", 0
    first_sec = spec.sections[0].name
    base = offsets[first_sec] - places[first_sec].offset
    for s in spec.sections:
        p = places[s.name]
        _, _, ch_stride, row_stride, n_ch = lay.sections[s.name]
        if offsets[s.name] != base + p.offset:
            return (f"{layout.value} places section {s.name!r} at byte {p.offset} of the state, the tensors at "
                    f"{offsets[s.name] - base}"), 0
        if n_ch > 1 and ch_stride != p.channel_stride:
            return (f"{layout.value} places the channels of section {s.name!r} {p.channel_stride} B apart, the "
                    f"tensor {ch_stride} B"), 0
        if s.rows > 1 and row_stride != p.row_stride:
            return (f"{layout.value} places the rows of section {s.name!r} {p.row_stride} B apart, the tensor "
                    f"{row_stride} B"), 0
    if base < 0:
        return f"{layout.value} would start the state {-base} B before its first section", 0
    return "", base


def _state_geometry(spec: StateSpec, layers: list[_StateLayer], placed: dict[tuple[Any, ...], tuple[int, int]],
                    tp: int, prefer: StateLayout | str | None, name: str) -> StateGroupGeometry:
    order = [StateLayout.CHANNEL_MAJOR, StateLayout.STATE_MAJOR]
    if prefer is not None:
        first = state_layout(prefer)
        order = [first] + [x for x in order if x is not first]
    chosen: StateLayout | None = None
    views: list[StateView] = []
    for lay in layers:
        where = {s: placed[v[0]] for s, v in lay.sections.items()}
        region_ids = {r for r, _ in where.values()}
        if len(region_ids) != 1:
            raise GeometryError(f"{name}.{lay.label}", f"the state tensors of one layer sit in regions "
                                f"{sorted(region_ids)}: a layer's state lives in one region", actual=sorted(region_ids),
                                expected="one region", fix="pass views of one allocation (the layer's state page)")
        region = region_ids.pop()
        offsets = {s: where[s][1] + lay.sections[s][1] for s in lay.sections}
        problems = []
        for layout in ([chosen] if chosen is not None else order):
            problem, base = _placement_problem(spec, layout, tp, lay, offsets)
            if not problem:
                chosen = layout
                views.append(StateView(region, base))
                break
            problems.append(problem)
        else:
            raise GeometryError(f"{name}.{lay.label}.channel", "the sections are not where kvgeom places them: "
                                + "; ".join(problems), actual={s: offsets[s] for s in offsets},
                                expected="channel_major or state_major placement (kvgeom.values.layout)",
                                fix="describe each tensor's channel and row axes, and keep vLLM's DS conv layout")
    if chosen is None:
        raise GeometryError(f"{name}.layers", f"no layer of state group {spec.name!r}", fix="give its tensors")
    return StateGroupGeometry(chosen, tuple(views))


# ---- overlap of different layers -------------------------------------------------------------------

def _check_layer_overlap(model: ModelSpec, tp: int, K: int, groups: list[GroupGeometry],
                         attn: dict[int, list[_AttnLayer]], states: dict[int, list[_StateLayer]], name: str) -> None:
    """Two layers of one group must not share a byte of a page (different groups may: the overlay).

    Every vector of a group has one length, so sorted by start, two overlap exactly when they are
    neighbours less than a length apart.
    """
    for gi, (spec, geo) in enumerate(zip(model.groups, groups)):
        per_region: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # region -> [(starts, layer ids)]
        if isinstance(geo, AttentionGroupGeometry) and isinstance(spec, AttentionSpec):
            h = local_count(spec.num_kv_heads, tp, replicated=spec.replicated)
            if spec.planes * h * K * len(geo.views) > MAX_PAGE_VECTORS:
                continue  # the engine rules refuse it with their own error
            lay = geo.layout
            length = spec.head_bytes
            if isinstance(lay, PlanesLayout):  # contiguous pieces of each plane (docs/design.md §3.5)
                length = min(contiguous_bytes(p.vector_modes, spec.head_bytes) for p in lay.planes)
                if (spec.planes * h * K * (spec.head_bytes // length) * len(geo.views) > MAX_PAGE_VECTORS
                        or spec.head_bytes > MAX_PAGE_VECTORS or K > MAX_PAGE_VECTORS):
                    continue
                for li, v in enumerate(geo.views):
                    for p, r in enumerate(v.regions):
                        q = lay.planes[p]
                        starts = (v.offset + q.offset + np.arange(h)[:, None, None] * q.head_stride
                                  + mode_offsets(q.token_modes)[None, :, None]
                                  + mode_offsets(q.vector_modes, spec.head_bytes)[::length][None, None, :]).ravel()
                        per_region.setdefault(r, []).append((starts, np.full(starts.size, li)))
            else:
                pl, hh, ss = np.meshgrid(np.arange(spec.planes), np.arange(h), np.arange(K), indexing="ij")
                for li, v in enumerate(geo.views):
                    for p, r in enumerate(v.regions):
                        starts = v.offset + pl[p].ravel() * lay.kv_stride + hh[p].ravel() * lay.head_stride \
                            + ss[p].ravel() * lay.token_stride
                        per_region.setdefault(r, []).append((starts, np.full(starts.size, li)))
            labels = [x.label for x in attn[gi]]
        elif isinstance(geo, StateGroupGeometry) and isinstance(spec, StateSpec):
            length = sum(p.local_channels * p.rows * p.unit_bytes for p in section_placements(spec, geo.layout, tp))
            for li, sv in enumerate(geo.views):
                per_region.setdefault(sv.region, []).append((np.array([sv.offset]), np.array([li])))
            labels = [x.label for x in states[gi]]
        else:
            continue
        for r, parts in per_region.items():
            starts = np.concatenate([a for a, _ in parts])
            owner = np.concatenate([b for _, b in parts])
            order = np.argsort(starts, kind="stable")
            s, o = starts[order], owner[order]
            hit = np.flatnonzero((np.diff(s) < length) & (o[1:] != o[:-1]))
            if hit.size:
                i = int(hit[0])
                a, b = labels[int(o[i])], labels[int(o[i + 1])]
                raise GeometryError(f"{name}.{b}", f"its bytes overlap {a}'s in region {r} (page bytes {int(s[i])} "
                                    f"and {int(s[i + 1])}, {length} B each): two layers of group {spec.name!r} share "
                                    "memory", actual=(a, b), expected="disjoint views",
                                    fix="pass each layer's own tensor (views of one allocation must not overlap)")

