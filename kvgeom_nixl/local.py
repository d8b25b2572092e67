"""Both engines of a pair on this machine: caches, simulator fills, endpoints, one transfer, a verdict.

    allocate_caches(engine)          caches[rank][region] = torch.empty(nbytes, uint8, device)
    fill_caches(pair, request, ...)  P: kvgeom.checking.fill_prefill, D: fill_decode (numpy views)
    LocalDeployment(pair, P, D)      one Endpoint (NIXL agent) per rank, every D rank linked to every
                                     P rank and back, all in this process
      .run(id, request, plan, push=False, mode="coalesced")   pull: D ranks READ, P ranks serve
                                                              push: P ranks WRITE, D ranks accept
    check_caches(pair, request, D)   kvgeom.checking.check_decode on every D byte

This is what ``kvgeom transfer`` runs, and what the executor tests use. On CUDA the caches live in
VRAM; fills and checks stage through host copies (the simulator is numpy).

Worked number: the default preset (P TP2 -> D TP4, 100 tokens) makes 2 + 4 = 6 agents, 4 D links
(each to both P ranks) and 2 P links (each to the 4 D ranks); a pull posts one NIXL request per
(D rank, P rank) pair that has rows: 4 here, as each D rank's heads live on one P rank. With
pipeline stages every rank of every stage gets an agent (``num_ranks``), registering only the
regions of its stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvgeom import Memory, Pair, Request, TransferPlan
from kvgeom.checking import check_decode, fill_decode, fill_prefill

from .endpoint import DEFAULT_TIMEOUT_S, Endpoint, Link
from .packed import DEFAULT_GRACE_S
from .staging import DEFAULT_SLOTS
from .transfer import Transfer, TransferResult, wait_all

__all__ = ["allocate_caches", "rank_buffers", "fill_caches", "check_caches", "host_memory", "LocalDeployment",
           "slot_bytes_for", "summarize"]

Caches = list[list[torch.Tensor]]


def allocate_caches(engine: Any, device: str | torch.device = "cpu") -> Caches:
    """One flat ``uint8`` tensor per region per rank (uninitialised); a region of another pipeline
    stage is an empty tensor on that rank (docs/design.md §11.4)."""
    dev = torch.device(device)
    out: Caches = []
    for rank in range(engine.num_ranks):
        held = set(engine.rank_regions(rank))
        out.append([torch.empty(r.nbytes if i in held else 0, dtype=torch.uint8, device=dev)
                    for i, r in enumerate(engine.regions)])
    return out


def rank_buffers(engine: Any, caches: Caches, rank: int) -> list[torch.Tensor]:
    """The tensors rank ``rank`` registers: one per region it holds (``engine.rank_regions(rank)``)."""
    return [caches[rank][i] for i in engine.rank_regions(rank)]


def host_memory(engine: Any, caches: Caches) -> Memory:
    """A simulator :class:`Memory` over the caches: the same bytes on CPU, a host copy on CUDA."""
    arrays = [[(t if t.device.type == "cpu" else t.cpu()).numpy() for t in regs] for regs in caches]
    return Memory.wrap(engine, arrays)


def _upload(mem: Memory, caches: Caches) -> None:
    for regs, bufs in zip(caches, mem.buffers, strict=True):
        for t, b in zip(regs, bufs, strict=True):
            if t.device.type != "cpu":
                t.copy_(torch.from_numpy(b))


def fill_caches(pair: Pair, request: Request, p_caches: Caches, d_caches: Caches) -> None:
    """The simulator's fills: coordinate hashes in P, the stale pattern (and the prefix) in D."""
    pm = host_memory(pair.prefill, p_caches)
    fill_prefill(pair, request, pm)
    _upload(pm, p_caches)
    dm = host_memory(pair.decode, d_caches)
    fill_decode(pair, request, dm)
    _upload(dm, d_caches)


def check_caches(pair: Pair, request: Request, d_caches: Caches, *, max_per_kind: int | None = 5) -> tuple[list[Any], int]:
    """Every D byte against the simulator's expectation: (violations, bytes checked)."""
    if any(t.device.type == "cuda" for regs in d_caches for t in regs):
        torch.cuda.synchronize()
    return check_decode(pair, request, host_memory(pair.decode, d_caches), max_per_kind=max_per_kind)


class LocalDeployment:
    """Every rank of both engines as an :class:`Endpoint` in this process, fully linked."""

    def __init__(self, pair: Pair, p_caches: Caches, d_caches: Caches, *, telemetry: bool = False,
                 staging_bytes: int = 0, staging_slots: int = DEFAULT_SLOTS,
                 staging_grace_s: float = DEFAULT_GRACE_S) -> None:
        self.pair = pair
        self.p: list[Endpoint] = []
        self.d: list[Endpoint] = []
        staging: dict[str, Any] = {"staging_bytes": staging_bytes, "staging_slots": staging_slots,
                                   "staging_grace_s": staging_grace_s, "warm_prober": False}  # connects unprobed
        try:
            self.p = [Endpoint(pair.prefill, "prefill", r, rank_buffers(pair.prefill, p_caches, r),
                               telemetry=telemetry, **staging) for r in range(pair.prefill.num_ranks)]
            self.d = [Endpoint(pair.decode, "decode", r, rank_buffers(pair.decode, d_caches, r),
                               telemetry=telemetry, **staging) for r in range(pair.decode.num_ranks)]
            p_payloads = [e.handshake() for e in self.p]
            d_payloads = [e.handshake() for e in self.d]
            # payloads of endpoints this process just made: no prober needed (kvgeom_nixl.probe)
            self.d_links: list[Link] = [e.connect(p_payloads, probe=False) for e in self.d]
            self.p_links: list[Link] = [e.connect(d_payloads, probe=False) for e in self.p]
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.p + self.d

    def post(self, request_id: str, request: Request | None, plan: TransferPlan | None, *, push: bool = False,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Transfer]:
        """Post both sides of one request (initiators first); nothing is waited for. With ``plan``
        None every link plans its own rank's part of ``request`` on the compiled pair."""
        out: list[Transfer] = []
        if push:
            out += [lk.push(request_id, request, plan=plan, mode=mode, timeout_s=timeout_s) for lk in self.p_links]
            out += [lk.accept_push(request_id, request, plan=plan, timeout_s=timeout_s) for lk in self.d_links]
        else:
            out += [lk.pull(request_id, request, plan=plan, mode=mode, timeout_s=timeout_s) for lk in self.d_links]
            out += [lk.serve_pull(request_id, request, plan=plan, timeout_s=timeout_s) for lk in self.p_links]
        return out

    def run(self, request_id: str, request: Request | None, plan: TransferPlan | None, *, push: bool = False,
            mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S) -> list[TransferResult]:
        """Post and drive one request to the end on every rank; raises TransferFailed."""
        return wait_all(self.post(request_id, request, plan, push=push, mode=mode, timeout_s=timeout_s),
                        peers=self.endpoints)

    def close(self) -> None:
        for e in self.endpoints:
            e.close()

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def slot_bytes_for(plan: TransferPlan, align: int = 4096) -> int:
    """The staging slot a plan needs on every rank: its busiest chunk on any rank, rounded up to
    ``align`` (0 for a plan without staging)."""
    if not plan.packed:
        return 0
    need = max(int(plan.staging_used("prefill").max(initial=0)), int(plan.staging_used("decode").max(initial=0)), 1)
    return -(-need // align) * align


def summarize(results: Sequence[TransferResult]) -> dict[str, Any]:
    """Totals over the initiators' results (descriptors and bytes are counted where they were posted)."""
    initiators = [r for r in results if r.kind in ("pull", "push")]
    receivers = [r for r in results if r.role == "decode"]
    descs = [r.nixl_descs for r in initiators]
    return {
        "bytes_moved": int(sum(r.bytes_moved for r in initiators)),
        "descriptors_posted": int(sum(r.descriptors for r in initiators)),
        "nixl_requests": int(sum(r.nixl_requests for r in initiators)),
        "nixl_descs": None if any(d is None for d in descs) else int(np.sum([d or 0 for d in descs])),
        "bytes_zeroed": int(sum(r.bytes_zeroed for r in receivers)),
        "rearranges_applied": int(sum(r.rearranges for r in receivers)),
        "pack_s": round(sum(r.pack_s for r in results if r.role == "prefill"), 6),
        "wire_s": round(sum(r.wire_s for r in initiators), 6),
        "unpack_s": round(sum(r.unpack_s for r in receivers), 6),
        "notes": sorted({n.text for r in results for n in r.notes}),  # texts: the summary is JSON
    }
