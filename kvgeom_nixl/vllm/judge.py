"""Two verdicts on one run of vLLM's NixlConnector: the bytes D holds, and kvgeom's conformance kit.

The byte check (:func:`byte_check`) knows nothing of kvgeom. It writes the expected D cache with
vLLM's own cache update (CPU_ATTN's ``do_kv_cache_update``: the pattern of P's tokens [0, M)
into D's blocks) and a token map the same way (every element of token t holds t + 1), then
compares D's real cache element by element:

    D tokens [S, M) of the request's new blocks    must equal the expected values     (else WRONG)
    D tokens >= M in those blocks                  anything (vLLM masks by length); counted as
                                                   zeroed / stale / written
    D's prefix blocks and every other block        must be untouched                   (else WRONG)

The kit check (:func:`kit_check`) describes both sides with kvgeom (``EngineGeometry.from_tensors``
on vLLM's own cache views and registered regions), builds the request from the block tables,
turns the recorded descriptor lists and READs into rows (``rows_from_descriptors``) with the
bytes vLLM's receive step zeroed (observed: D's cache just before and after it), and runs
``check_connector``. A side kvgeom cannot describe is a typed refusal (``GeometryError``), found
by asking vLLM's writer where the tokens of a block land (docs/design.md §10.6).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .engines import STALE_D, VllmSide

__all__ = ["byte_check", "kit_check", "describe_side", "element_map", "pattern", "MAX_TOKENS"]

_MAX_LISTED = 6
MAX_TOKENS = 1024  # the pattern's token axis (values stay exact in float32)


def pattern(layer: int, tokens: torch.Tensor, plane: int, heads: range, head_dim: int,
            total_heads: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A value per (layer, plane, global head, token, dim), never 0 or stale.

    float32: the coordinate's number + 1, exact while ``layers * 2 * total_heads * MAX_TOKENS *
    head_dim < 2**24`` (tiny Llama: 0.5M; MLA: 2.4M). bfloat16 (8-bit mantissa): a 13-bit hash of
    it as the mantissa and low exponent bits of a positive normal number (bits 0x3800 + hash), so
    neighbouring tokens and dims differ; a wrong token differs in almost all of its elements.
    """
    h = torch.tensor(list(heads), dtype=torch.int64).view(1, -1, 1)
    t = tokens.to(torch.int64).view(-1, 1, 1)
    d = torch.arange(head_dim, dtype=torch.int64).view(1, 1, -1)
    code = (((layer * 2 + plane) * total_heads + h) * MAX_TOKENS + t) * head_dim + d
    if dtype == torch.bfloat16:
        bits = 0x3800 + (code * 2654435761 >> 7) % 0x1FFF
        return bits.to(torch.int16).view(torch.bfloat16)
    return (code + 1).to(torch.float32)


def _numbers(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive ints below 2**14 as ``dtype``, recoverable exactly by :func:`_decode`: float32 holds
    the number; bfloat16 holds bits ``0x3F80 + n`` (distinct positive normal numbers)."""
    if dtype == torch.bfloat16:
        return (values.to(torch.int64) + 0x3F80).to(torch.int16).view(torch.bfloat16)
    return values.to(dtype)


def _decode(values: torch.Tensor) -> torch.Tensor:
    """The ints :func:`_numbers` stored."""
    if values.dtype == torch.bfloat16:
        return values.contiguous().view(torch.int16).to(torch.int64) - 0x3F80
    return values.to(torch.int64)


def _fresh(side: VllmSide, value: float) -> list[dict[str, torch.Tensor]]:
    from vllm.v1.worker.utils import allocate_kv_cache

    out = []
    for _ in range(side.tp):
        caches = allocate_kv_cache(side.kv_cache_config, torch.device("cpu"),
                                   side.config.cache_config.get_resolved_kv_cache_layout(), [side.block_size])
        for c in caches.values():
            c.fill_(value)
        out.append(caches)
    return out


def _spans(tokens: np.ndarray) -> str:
    tokens = np.unique(tokens)
    if not tokens.size:
        return ""
    cuts = np.flatnonzero(np.diff(tokens) != 1)
    starts = np.r_[tokens[0], tokens[cuts + 1]]
    ends = np.r_[tokens[cuts], tokens[-1]]
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in zip(starts.tolist(), ends.tolist()))


def byte_check(D: VllmSide, before: list[dict[str, torch.Tensor]], cell: Any, d_all: list[int], held: int,
               values: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """Compare D's cache with what vLLM's own writer puts there for the request (module docstring)."""
    expected = _fresh(D, STALE_D)
    marks = _fresh(D, 0.0)
    listed = len(d_all) * D.block_size
    hd = D.model.head_dim
    for r in range(D.tp):
        heads = D.heads(r)
        D.write_tokens(r, d_all, range(cell.m),
                       lambda i, t, plane, h=heads: values(i, t, plane, h, hd, D.model.kv_heads, D.model.torch_dtype),
                       caches=expected[r])
        D.write_tokens(r, d_all, range(listed),
                       lambda i, t, plane: _numbers(t + 1, D.model.torch_dtype).view(-1, 1, 1)
                       .expand(-1, D.kv_heads, hd).contiguous(), caches=marks[r])
    wrong: list[str] = []
    counts = {"wrong_tokens": 0, "missing_tokens": 0, "beyond_zeroed": 0, "beyond_stale": 0, "beyond_written": 0,
              "foreign_elements": 0, "prefix_clobbered": 0}
    new = set(d_all[held:])
    for r in range(D.tp):
        for li, name in enumerate(D.layers):
            act, exp, mark, old = D.caches[r][name], expected[r][name], marks[r][name], before[r][name]
            for b in range(act.shape[0]):
                a = act[b]
                if b in new:
                    tok = _decode(mark[b]) - 1
                    needed = (tok >= cell.s) & (tok < cell.m)
                    bad = needed & (a != exp[b])
                    if bool(bad.any()):
                        toks = torch.unique(tok[bad]).numpy()
                        counts["wrong_tokens"] += int(toks.size)
                        counts["missing_tokens"] += int(torch.unique(tok[bad & (a == STALE_D)]).numel())
                        if len(wrong) < _MAX_LISTED:
                            wrong.append(f"D rank {r} layer {li} block {b}: tokens {_spans(toks)} differ")
                    beyond = tok >= cell.m
                    counts["beyond_zeroed"] += int(torch.unique(tok[beyond & (a == 0)]).numel())
                    counts["beyond_stale"] += int(torch.unique(tok[beyond & (a == STALE_D)]).numel())
                    counts["beyond_written"] += int(torch.unique(tok[beyond & (a != 0) & (a != STALE_D)]).numel())
                elif not torch.equal(a, old[b]):
                    key = "prefix_clobbered" if b in d_all else "foreign_elements"
                    counts[key] += int((a != old[b]).sum())
                    if len(wrong) < _MAX_LISTED:
                        wrong.append(f"D rank {r} layer {li} block {b}: "
                                     f"{'prefix block' if b in d_all else 'not the request'} changed")
    ok = not (counts["wrong_tokens"] or counts["foreign_elements"] or counts["prefix_clobbered"])
    return {"ok": ok, "counts": counts, "wrong": wrong}


# ---- kvgeom's description of a side ------------------------------------------------------------


def element_map(side: VllmSide) -> dict[str, np.ndarray]:
    """Where vLLM's writer puts each (token, dim) of one block of head 0: per plane, an array whose
    entry ``[row, col]`` of the plane's ``(bs, head_dim)`` view is ``(token, dim)`` stored there.

    CPU_ATTN's block is viewed ``(heads, 2 * bs, head_dim)``: K rows ``[0, bs)``, V rows
    ``[bs, 2 bs)``. Every element is written with its own value into a scratch cache, then read back.
    """
    bs, hd, dt = side.block_size, side.model.head_dim, side.model.torch_dtype

    def probe(per_token: bool) -> np.ndarray:
        """The token (or dim) stored at each position of block 1, head 0, as written by vLLM."""
        scratch = _fresh(side, 0.0)[0]

        def number(i: int, t: torch.Tensor, plane: int) -> torch.Tensor:
            t = t.view(-1, 1, 1).expand(-1, side.kv_heads, hd)
            d = torch.arange(hd).view(1, 1, -1).expand(t.shape[0], side.kv_heads, hd)
            return _numbers((t if per_token else d) + 1, dt).contiguous()

        side.write_tokens(0, [1], range(bs), number, caches=scratch)
        return (_decode(next(iter(scratch.values()))[1]) - 1).numpy()

    tok, dim = probe(True), probe(False)
    if side.model.mla:  # one latent plane: (1, bs, 512 + 64)
        planes = {"latent": (tok.reshape(bs, hd), dim.reshape(bs, hd))}
    else:  # CPU_ATTN: (heads, 2 * bs, hd), K rows then V rows
        t2, d2 = tok.reshape(side.kv_heads, 2 * bs, hd)[0], dim.reshape(side.kv_heads, 2 * bs, hd)[0]
        planes = {"k": (t2[:bs], d2[:bs]), "v": (t2[bs:], d2[bs:])}
    return {plane: np.stack([t, d], axis=-1) for plane, (t, d) in planes.items()}


def describe_side(side: VllmSide, rank: int, name: str) -> Any:
    """kvgeom's geometry of one rank of ``side``, or a ``GeometryError`` naming what it cannot say."""
    from kvgeom import AttentionSpec, EngineGeometry, GeometryError, LayerTensors, ModelSpec

    if side.backend_name not in ("CPU_ATTN", "CPU_MLA", "AMX_MLA"):
        raise GeometryError(f"{name}.backend", f"only CPU_ATTN and CPU_MLA / AMX_MLA caches are described here, got "
                            f"{side.backend_name}", actual=side.backend_name, expected="CPU_ATTN, CPU_MLA or AMX_MLA")
    bs, hd = side.block_size, side.model.head_dim
    plain = np.stack(np.meshgrid(np.arange(bs), np.arange(hd), indexing="ij"), axis=-1)
    for plane, where in element_map(side).items():
        if not np.array_equal(where, plain):
            r, c = (int(x) for x in np.argwhere((where != plain).any(axis=-1))[0])
            t, d = (int(x) for x in where[r, c])
            raise GeometryError(
                f"{name}.layers.0.{plane}.dim",
                f"{side.backend_name} stores {plane.upper()} of a {bs}-token block with token {t} dim {d} at row {r} column "
                f"{c} of the plane's (token, dim) rows: a head vector is not {hd * 4} contiguous bytes "
                f"(K is dim-major in 32-token tiles), which kvgeom's page layout cannot say",
                actual=f"(row {r}, col {c}) holds token {t} dim {d}", expected=f"token {r} dim {c}",
                fix="describe per-plane layouts with strided head-vector bytes (issue 22) before checking this")
    if side.model.mla:
        model = ModelSpec("tiny-deepseek", [AttentionSpec("mla", "mla", num_layers=side.model.layers,
                                                          num_kv_heads=1, head_bytes=hd * side.model.torch_dtype.itemsize)])
    else:
        model = ModelSpec("tiny-llama", [AttentionSpec("attn", "full", num_layers=side.model.layers,
                                                       num_kv_heads=side.model.kv_heads, head_bytes=hd * 4)])
    worker = side.worker(rank)
    bases = worker.kv_caches_base_addr[side.engine_id][rank]
    regions = [(int(b), int(n) * int(s)) for b, n, s in zip(bases, worker.region_num_blocks or
                                                            [worker.num_blocks] * len(bases),
                                                            worker.block_stride_per_layer)]
    layers = []
    for lname in sorted(side.layers, key=lambda n: int(n.split(".")[2])):
        cache = side.caches[rank][lname]
        if side.model.mla:  # CPU_MLA: (B, 1, bs, 576)
            layers.append(LayerTensors("mla", "page head token dim", cache, name=lname))
            continue
        view = cache.view(cache.shape[0], cache.shape[1], 2, bs, hd)  # CPU_ATTN: (B, H, 2 * bs, hd), chunked
        layers.append(LayerTensors("attn", "page head kv token dim", view, name=lname))
    return EngineGeometry.from_tensors(model, tp=side.tp, layers=layers, regions=regions, name=name)


def _engine(side: VllmSide, name: str) -> Any:
    geos = [describe_side(side, r, name) for r in range(side.tp)]
    return geos[0]  # every rank has the same geometry; addresses come from the handshake


# ---- the kit's verdict -------------------------------------------------------------------------


def _zeros_from(D: VllmSide, snapshots: list[Any]) -> tuple[list[tuple[int, int, int]], list[str]]:
    """The byte ranges vLLM's receive step zeroed (D's cache before it vs after), and what else it moved."""
    zeros: list[tuple[int, int, int]] = []
    moved: list[str] = []
    if not snapshots:
        return zeros, moved
    snap = snapshots[0]
    for r in range(D.tp):
        for name, cache in D.caches[r].items():
            a = snap[r][name].contiguous().view(torch.uint8).flatten().numpy()
            b = cache.contiguous().view(torch.uint8).flatten().numpy()
            changed = a != b
            if not changed.any():
                continue
            if bool((b[changed] != 0).any()):
                moved.append(f"D rank {r} {name}: {int((changed & (b != 0)).sum())} B rearranged")
            z = np.flatnonzero(np.diff(np.r_[0, (changed & (b == 0)).astype(np.int8), 0]))
            base = cache.data_ptr()
            zeros += [(r, base + int(s), int(e - s)) for s, e in zip(z[::2], z[1::2])]
    return zeros, moved


def kit_check(P: VllmSide, D: VllmSide, cell: Any, p_blocks: list[int], d_all: list[int],
              snapshots: list[Any]) -> dict[str, Any]:
    """kvgeom's verdict on the recorded transfer (module docstring); ``verdict`` UNDESCRIBABLE on a refusal."""
    from kvgeom import GeometryError, Pair, ViolationKind, request_from_block_tables
    from kvgeom.conformance import DescriptorTable, Read, check_connector, rows_from_descriptors

    out: dict[str, Any] = {"verdict": "", "counts": {}, "ignored": {}, "lines": [], "refusal": ""}
    try:
        pair = Pair(_engine(P, "prefill"), _engine(D, "decode"))
    except GeometryError as e:
        out["verdict"], out["refusal"] = "UNDESCRIBABLE", f"GeometryError: {e}"
        return out
    held = cell.s // D.block_size  # D lists its blocks from S on (the held prefix is not part of the transfer)
    request = request_from_block_tables(pair, cell.m, [p_blocks], [d_all[held:]], prefix_hit_tokens=cell.s)
    p_bases = [P.worker(r).kv_caches_base_addr["P"][r] for r in range(P.tp)]
    d_bases = [D.worker(r).kv_caches_base_addr["D"][r] for r in range(D.tp)]
    reads = []
    for r in range(D.tp):
        agent, worker = D.agent(r), D.worker(r)
        rank_of = {name: pr for (_, pr), name in worker._remote_agents["P"].items()}
        for p in agent.posted:
            if p.raw is not None:
                raise NotImplementedError("a raw initialize_xfer transfer: not produced by vLLM's pull connector")
            local, remote = agent.list_of(p.local_handle), agent.list_of(p.remote_handle)
            reads.append(Read(r, rank_of[remote.agent], DescriptorTable.from_descs(local.descs), p.local_ids,
                              DescriptorTable.from_descs(remote.descs), p.remote_ids))
    zeros, moved = _zeros_from(D, snapshots)
    if moved:
        out["verdict"], out["refusal"] = "UNDESCRIBABLE", "receive step rearranged bytes: " + "; ".join(moved)
        return out
    rows, unresolved = rows_from_descriptors(pair, prefill_bases=p_bases, decode_bases=d_bases, reads=reads,
                                             zeros=zeros)
    policy = "beyond_computed" in inspect.signature(check_connector).parameters
    if policy:
        vllm_contract: dict[str, Any] = {"beyond_computed": "any"}  # the kit's policy keyword (issue 21, item 2)
        report = check_connector(pair, request, rows, unresolved=unresolved, **vllm_contract)
        counts = {k.value: n for k, n in report.counts.items() if n}
        ignored = {k.value: n for k, n in report.ignored.items() if n}
        lines = [str(v) for v in report.violations]
    else:  # the kit before the beyond_computed policy: findings wholly past M are vLLM's contract, not defects
        report = check_connector(pair, request, rows, unresolved=unresolved)
        counts, ignored, lines = {}, {}, []
        for kind, n in report.counts.items():
            listed = report.of_kind(kind)
            past = [v for v in listed if v.tokens is not None and v.tokens[0] >= cell.m
                    and kind in (ViolationKind.WRONG_DATA, ViolationKind.NOT_ZEROED)]
            if n and len(listed) == n and past:  # every finding is listed: those wholly past M are vLLM's contract
                ignored["beyond_computed"] = ignored.get("beyond_computed", 0) + len(past)
                n -= len(past)
            if n:
                counts[kind.value] = n
                lines += [str(v) for v in listed if v not in past]
        for kind, n in report.ignored.items():
            ignored[kind.value] = n
    out["verdict"] = "CONFORMS" if not counts else "WRONG"
    out["counts"], out["ignored"], out["lines"] = counts, ignored, lines[:12]
    return out
