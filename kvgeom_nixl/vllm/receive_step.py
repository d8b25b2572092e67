"""vLLM's receive step on D, recorded and said in kvgeom's terms (docs/design.md §10.4, §10.6).

When D's READs are done, vLLM's worker may change D's cache once more
(``NixlConnectorWorker.get_transfer_results``):

    post_process_device_kv_on_receive(ratio, [(group, D blocks, covered P blocks)], convert)
        convert:  regroup each D block from ``ratio`` arrived P blocks      -> regroup_rearrange (per layer)
        a partly covered last block: cache[block, :, t:].zero_()           -> page_tail_zeros
        blocks past the covered ones: cache.index_fill_(0, blocks, 0)      -> whole pages zeroed
    _zero_region_blocks(region -> pages)                                   -> whole region pages zeroed

:func:`watch_receive` wraps both methods of one worker and records each call with the rank's
cache just before it (:class:`ReceiveCall`). :func:`receive_steps` turns the calls into the
``rearranges=`` and ``zeros=`` that :func:`kvgeom.conformance.rows_from_descriptors` takes, with
the layer, region and page numbers vLLM's worker itself uses (``transfer_groups``,
``region_names``, ``kv_caches_base_addr``, ``block_stride_per_layer``). :func:`replay_matches`
checks that translation against the bytes: the steps applied to the recorded "before" cache (a
numpy transcription of the ``Rearrange`` formula of §4.1, not kvgeom's applier) must give exactly
the cache vLLM left, and the same steps with the other page order (a control) must not, wherever
a regroup moved bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .engines import VllmSide

__all__ = ["ReceiveCall", "watch_receive", "receive_steps", "replay_matches", "storages"]


@dataclass
class ReceiveCall:
    """One call of vLLM's receive step on one D rank, with that rank's caches just before it."""

    rank: int
    kind: str  # "post_process" or "zero_region_blocks"
    ratio: int = 1
    blocks: list[tuple[int, list[int], int]] = field(default_factory=list)
    convert: bool = False
    permute: bool = False  # the worker's enable_permute_local_kv (LBHNC remote into an LBNHC cache)
    region_blocks: list[list[int]] = field(default_factory=list)
    before: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # storage address -> its bytes

    def __str__(self) -> str:
        if self.kind == "zero_region_blocks":
            return f"D rank {self.rank}: _zero_region_blocks({self.region_blocks})"
        return (f"D rank {self.rank}: post_process_device_kv_on_receive(ratio={self.ratio}, "
                f"blocks={self.blocks}, convert={self.convert})")


def watch_receive(D: VllmSide, rank: int, calls: list[ReceiveCall]) -> None:
    """Record every receive-step call of D's worker ``rank`` in ``calls`` (the calls still run)."""
    worker = D.worker(rank)
    post, zero = worker.post_process_device_kv_on_receive, worker._zero_region_blocks

    def snapshot() -> dict[int, np.ndarray]:
        return {a: b.copy() for a, b in storages(D, rank).items()}

    def post_process(block_size_ratio: int, block_ids_list: list[Any], convert: bool = True) -> Any:
        calls.append(ReceiveCall(rank, "post_process", int(block_size_ratio),
                                 [(int(g), [int(b) for b in ids], int(c)) for g, ids, c in block_ids_list],
                                 bool(convert), bool(worker.enable_permute_local_kv), before=snapshot()))
        return post(block_size_ratio, block_ids_list, convert)

    def zero_region_blocks(block_ids: Any) -> Any:
        calls.append(ReceiveCall(rank, "zero_region_blocks", region_blocks=[[int(b) for b in ids] for ids in block_ids],
                                 before=snapshot()))
        return zero(block_ids)

    worker.post_process_device_kv_on_receive = post_process
    worker._zero_region_blocks = zero_region_blocks


def _page_order(D: VllmSide, call: ReceiveCall, flip: bool = False) -> str:
    """The page order vLLM's regroup writes: LBNHC when it also permutes the layout, else the cache's own
    (only LBHNC's regroup is vLLM's plain ``kv_postprocess_blksize_on_receive`` on ``[H, N, C]`` pages)."""
    order = "LBNHC" if call.permute else str(D.worker(call.rank).kv_cache_layout)
    if order not in ("LBHNC", "LBNHC"):
        raise NotImplementedError(f"vLLM's receive regroup on a {order} cache is not modelled here")
    if flip:
        return "LBNHC" if order == "LBHNC" else "LBHNC"
    return order


def _region_of(worker: Any, bases: list[int], address: int) -> int:
    counts = worker.region_num_blocks or [worker.num_blocks] * len(bases)
    for region, (base, n, stride) in enumerate(zip(bases, counts, worker.block_stride_per_layer)):
        if int(base) <= address < int(base) + int(n) * int(stride):
            return region
    raise ValueError(f"address {address:#x} is in no registered region")


def _memory_order(D: VllmSide, rank: int) -> str:
    order = str(D.worker(rank).kv_cache_layout)
    if order not in ("LBHNC", "LBNHC"):
        raise NotImplementedError(f"vLLM's receive zeroing on a {order} cache is not modelled here")
    return order


def receive_steps(D: VllmSide, calls: list[ReceiveCall], *, flip_order: bool = False
                  ) -> tuple[list[Any], list[tuple[int, int, int]]]:
    """The recorded calls as kvgeom ``Rearrange`` records and ``(d_rank, address, nbytes)`` zero ranges.

    ``flip_order`` writes every regroup in the other page order (the control of :func:`replay_matches`).
    """
    from vllm.v1.attention.backends.utils import KVCacheLayout

    from kvgeom.conformance import page_tail_zeros, regroup_rearrange

    rearranges: list[Any] = []
    zeros: list[tuple[int, int, int]] = []
    for call in calls:
        worker, r = D.worker(call.rank), call.rank
        bases = worker.kv_caches_base_addr[D.engine_id][r]
        strides, lengths = worker.block_stride_per_layer, worker.block_len_per_layer
        if call.kind == "zero_region_blocks":
            for region, pages in enumerate(call.region_blocks):
                zeros += [(r, int(bases[region]) + p * int(strides[region]), int(lengths[region])) for p in pages]
            continue
        for g, block_ids, covered in call.blocks:
            names = list(D.kv_cache_config.transfer_groups[g].layer_names)
            covered_blocks, in_last = divmod(covered, call.ratio)
            first_stale = covered_blocks + (1 if in_last else 0)
            regroup = call.convert and (call.permute or KVCacheLayout[worker.kv_cache_layout].is_block_contiguous)
            for name in names:
                cache = D.caches[r][name]
                heads, tokens = int(cache.shape[1]), int(cache.shape[2])
                cell = int(cache.shape[3]) * cache.element_size()
                if regroup:  # the region holding the layer (a hybrid's region is named after its mamba layer)
                    region = _region_of(worker, bases, cache.data_ptr())
                    offset = cache.data_ptr() - int(bases[region])
                    rearranges.append(regroup_rearrange(r, region, block_ids, heads=heads, tokens=tokens,
                                                        cell_bytes=cell, ratio=call.ratio,
                                                        page_bytes=int(strides[region]), offset=offset,
                                                        local_order=_page_order(D, call, flip_order)))
                if in_last:  # cache[block, :, t:] of the [B, H, N, C] view, in the cache's memory order
                    last = block_ids[covered_blocks]
                    zeros += page_tail_zeros(r, cache[last].data_ptr(), heads=heads, tokens=tokens, cell_bytes=cell,
                                             from_token=in_last * (tokens // call.ratio),
                                             local_order=_memory_order(D, r))
                for b in block_ids[first_stale:]:
                    zeros.append((r, cache[b].data_ptr(), cache[b].nbytes))
    return rearranges, zeros


def storages(D: VllmSide, rank: int) -> dict[int, np.ndarray]:
    """Every allocation behind the rank's caches as a flat byte array (a view, not a copy), by address:
    a hybrid's attention and mamba layers are views of the same bytes."""
    out: dict[int, np.ndarray] = {}
    for cache in D.caches[rank].values():
        storage = cache.untyped_storage()
        if storage.data_ptr() not in out:
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            out[storage.data_ptr()] = flat.numpy()
    return out


def _apply(D: VllmSide, rank: int, start: dict[int, np.ndarray], rearranges: list[Any],
           zeros: list[tuple[int, int, int]]) -> dict[int, np.ndarray]:
    """The steps of ``rank`` applied to a copy of ``start`` (allocations by address)."""
    out = {a: b.copy() for a, b in start.items()}
    bases = D.worker(rank).kv_caches_base_addr[D.engine_id][rank]

    def locate(address: int) -> tuple[np.ndarray, int]:
        for base, buf in out.items():
            if base <= address < base + buf.size:
                return buf, address - base
        raise ValueError(f"address {address:#x} is in no cache of D rank {rank}")

    for r in (x for x in rearranges if x.d_rank == rank):
        grid = np.indices(r.shape).reshape(len(r.shape), -1).T
        src = r.src_offset + grid @ np.asarray(r.src_strides, dtype=np.int64)
        dst = r.dst_offset + grid @ np.asarray(r.dst_strides, dtype=np.int64)
        unit = np.arange(r.unit_bytes)
        for page in r.pages:
            buf, at = locate(int(bases[r.d_region]) + page * r.page_bytes)
            values = buf[(at + src)[:, None] + unit].copy()  # every source read before any write
            buf[(at + dst)[:, None] + unit] = values
    for d, address, n in zeros:
        if d == rank:
            buf, at = locate(address)
            buf[at:at + n] = 0
    return out


def replay_matches(D: VllmSide, calls: list[ReceiveCall]) -> dict[str, Any]:
    """Whether :func:`receive_steps` reproduces what vLLM's receive step did to D's cache, per rank
    (``matches``), and whether the other page order fails to (``control_differs``; None where no regroup
    moved a byte). Call it right after the transfer finished, before anything else writes D's cache."""
    out: dict[str, Any] = {"calls": len(calls), "matches": True, "control_differs": None, "first_difference": ""}
    if not calls:
        return out
    steps = receive_steps(D, calls)
    control = receive_steps(D, calls, flip_order=True)
    for rank in sorted({c.rank for c in calls}):
        start = next(c.before for c in calls if c.rank == rank)
        actual = storages(D, rank)
        ours = _apply(D, rank, start, *steps)
        for n in actual:
            if not np.array_equal(ours[n], actual[n]):
                at = int(np.flatnonzero(ours[n] != actual[n])[0])
                out["matches"] = False
                out["first_difference"] = out["first_difference"] or f"D rank {rank} address {n + at:#x}"
        if any(x.d_rank == rank for x in steps[0]):
            flipped = _apply(D, rank, start, *control)
            differs = any(not np.array_equal(flipped[n], actual[n]) for n in actual)
            out["control_differs"] = differs if out["control_differs"] is None else out["control_differs"] and differs
    return out
