"""Two verdicts on one run of vLLM's NixlConnector: the bytes D holds, and kvgeom's conformance kit.

The byte check (:func:`byte_check`) knows nothing of kvgeom. It writes the expected D cache with
vLLM's own cache update (CPU_ATTN's ``do_kv_cache_update``: the pattern of P's tokens [0, M)
into D's blocks) and a token map the same way (every element of token t holds t + 1), then
compares D's real cache element by element:

    D tokens [S, M) of the request's new blocks    must equal the expected values     (else WRONG)
    D tokens >= M in those blocks                  anything (vLLM masks by length); counted as
                                                   zeroed / stale / written
    D's prefix blocks and every other block        must be untouched                   (else WRONG)

A hybrid's mamba state is checked the same way: D's state block must hold exactly what P's state
block held (both written through vLLM's own state views), every other state block untouched.

The kit check (:func:`kit_check`) describes both sides with kvgeom (:mod:`.describe`:
``EngineGeometry.from_tensors`` on vLLM's own cache views and registered regions, checked against
kvgeom's builders and vLLM's writer), builds the request from the block tables, turns the
recorded descriptor lists and READs into rows (``rows_from_descriptors``) together with vLLM's
receive step said in kvgeom's terms (:mod:`.receive`: its block-size regroup as ``Rearrange``
records, its zeroing as zero ranges), and runs ``check_connector``. A side kvgeom cannot describe
is a typed refusal (``GeometryError``, reported as UNDESCRIBABLE; docs/design.md §10.6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .engines import STALE_D, VllmSide
from .patterns import decode_numbers, fresh_caches, numbers, state_pattern

__all__ = ["byte_check", "kit_check"]

_MAX_LISTED = 6


def _spans(tokens: np.ndarray) -> str:
    tokens = np.unique(tokens)
    if not tokens.size:
        return ""
    cuts = np.flatnonzero(np.diff(tokens) != 1)
    starts = np.r_[tokens[0], tokens[cuts + 1]]
    ends = np.r_[tokens[cuts], tokens[-1]]
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in zip(starts.tolist(), ends.tolist()))


def byte_check(D: VllmSide, before: list[dict[str, torch.Tensor]], cell: Any, d_all: list[int], held: int,
               values: Callable[..., torch.Tensor], d_state: int | None = None) -> dict[str, Any]:
    """Compare D's cache with what vLLM's own writer puts there for the request (module docstring).

    ``d_state``: a hybrid's D state block, which must hold P's state (:func:`state_pattern`)."""
    expected = fresh_caches(D, STALE_D)
    marks = fresh_caches(D, 0.0)
    listed = len(d_all) * D.block_size
    hd = D.model.head_dim
    for r in range(D.tp):
        heads = D.heads(r)
        D.write_tokens(r, d_all, range(cell.m),
                       lambda i, t, plane, h=heads: values(i, t, plane, h, hd, D.model.kv_heads, D.model.torch_dtype),
                       caches=expected[r])
        D.write_tokens(r, d_all, range(listed),
                       lambda i, t, plane: numbers(t + 1, D.model.torch_dtype).view(-1, 1, 1)
                       .expand(-1, D.kv_heads, hd).contiguous(), caches=marks[r])
        if d_state is not None:
            D.write_states(r, d_state, state_pattern, caches=expected[r])
    wrong: list[str] = []
    counts = {"wrong_tokens": 0, "missing_tokens": 0, "beyond_zeroed": 0, "beyond_stale": 0, "beyond_written": 0,
              "foreign_elements": 0, "prefix_clobbered": 0, "wrong_states": 0}
    new = set(d_all[held:])
    attention = [n for g in D.groups() if g.kind != "mamba" for n in g.layers]
    # a hybrid's groups overlay one another's pages (vLLM's hybrid manager hands each block id to one group):
    # a view skips the blocks the other group's view checks
    state_blocks = set() if d_state is None else {d_state}
    for r in range(D.tp):
        for li, name in enumerate(attention):
            act, exp, mark, old = D.caches[r][name], expected[r][name], marks[r][name], before[r][name]
            for b in range(act.shape[0]):
                a = act[b]
                if b in state_blocks:
                    continue
                if b in new:
                    tok = decode_numbers(mark[b]) - 1
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
        states = [n for g in D.groups() if g.kind == "mamba" for n in g.layers]
        for li, name in enumerate(states):
            act, exp, old = D.caches[r][name], expected[r][name], before[r][name]
            for b in range(act.shape[0]):
                if b in d_all:
                    continue  # an attention page (checked above)
                if b == d_state:
                    if not torch.equal(act[b], exp[b]):
                        counts["wrong_states"] += 1
                        if len(wrong) < _MAX_LISTED:
                            diff = int((act[b] != exp[b]).sum())
                            wrong.append(f"D rank {r} mamba layer {li} state block {b}: {diff} bytes differ")
                elif not torch.equal(act[b], old[b]):
                    counts["foreign_elements"] += int((act[b] != old[b]).sum())
                    if len(wrong) < _MAX_LISTED:
                        wrong.append(f"D rank {r} mamba layer {li} block {b}: not the request, changed")
    ok = not (counts["wrong_tokens"] or counts["foreign_elements"] or counts["prefix_clobbered"]
              or counts["wrong_states"])
    return {"ok": ok, "counts": counts, "wrong": wrong}


# ---- the kit's verdict -------------------------------------------------------------------------


def kit_check(P: VllmSide, D: VllmSide, cell: Any, p_lists: list[list[int]], d_lists: list[list[int]],
              calls: list[Any]) -> dict[str, Any]:
    """kvgeom's verdict on the recorded transfer (module docstring); ``verdict`` UNDESCRIBABLE on a refusal.

    ``p_lists`` / ``d_lists``: the block ids of each of vLLM's groups (in its group order) that P
    listed and that D receives into (after its prefix hit); ``calls``: the recorded receive step."""
    from kvgeom import GeometryError, Pair, request_from_block_tables
    from kvgeom.conformance import DescriptorTable, Read, check_connector, rows_from_descriptors

    from .describe import describe_side
    from .receive_step import receive_steps

    out: dict[str, Any] = {"verdict": "", "counts": {}, "ignored": {}, "lines": [], "refusal": "", "receive": {},
                           "where": []}
    try:
        # every rank has the same geometry (vLLM allocates each rank alike); addresses come from the handshake
        geos = {}
        for side, name in ((P, "prefill"), (D, "decode")):
            geos[side.engine_id] = first = describe_side(side, 0, name)
            for r in range(1, side.tp):
                describe_side(side, r, name, like=first)
        pair = Pair(geos["P"], geos["D"])
    except GeometryError as e:
        out["verdict"], out["refusal"] = "UNDESCRIBABLE", f"GeometryError: {e}"
        return out
    request = request_from_block_tables(pair, cell.m, p_lists, d_lists, prefix_hit_tokens=cell.s)
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
    try:
        rearranges, zeros = receive_steps(D, calls)
    except NotImplementedError as e:
        out["verdict"], out["refusal"] = "UNDESCRIBABLE", f"receive step: {e}"
        return out
    out["receive"] = {"rearranges": len(rearranges), "zero_ranges": len(zeros),
                      "rearranged_pages": sum(len(x.pages) for x in rearranges)}
    rows, unresolved = rows_from_descriptors(pair, prefill_bases=p_bases, decode_bases=d_bases, reads=reads,
                                             zeros=zeros, rearranges=rearranges)
    # vLLM's contract for D tokens past M: attention masks by length (design §10.4)
    report = check_connector(pair, request, rows, unresolved=unresolved, beyond_computed="any")
    counts = {k.value: n for k, n in report.counts.items() if n}
    out["verdict"] = "CONFORMS" if not counts else "WRONG"
    out["counts"], out["ignored"] = counts, {k.value: n for k, n in report.ignored.items() if n}
    out["lines"] = [str(v) for v in report.violations][:12]
    # where the listed findings are (at most 20 per kind are listed): kind, side, group, layer, block
    out["where"] = sorted({(v.kind.value, v.side, v.group or "", -1 if v.layer is None else v.layer,
                            -1 if v.block is None else v.block) for v in report.violations})
    return out
