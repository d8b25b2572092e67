"""The executor on topologies (docs/design.md §11, §8): every rank of every stage in one process, real
NIXL agents, every D byte checked by the simulator.

A rank registers only its stage's regions (``engine.rank_regions(rank)``); a D rank connects to the
handshakes of every P rank of every stage and posts one NIXL request per P rank its rows name,
which are exactly the P ranks holding its layers and tokens (``plan.sources_of``). The
cross-process cases are in ``tests/test_nixl_crossprocess.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

from kvgeom import (  # noqa: E402
    AttentionSpec,
    Copies,
    EngineGeometry,
    ModelSpec,
    Pair,
    Request,
    StateSection,
    StateSpec,
    Topology,
    TransferPlan,
    fresh_request,
    min_staging_bytes,
    plan_pair,
)
from kvgeom_nixl import Endpoint, HandshakeError, RegistrationError, TransferFailed, decode_rank  # noqa: E402
from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches, rank_buffers  # noqa: E402
from kvgeom_nixl.testing import requested_device, run_local  # noqa: E402

DEVICE = requested_device()


def _pair(p: dict[str, Any], d: dict[str, Any], model: ModelSpec, blocks: int = 12) -> Pair:
    return Pair(EngineGeometry.build(model, num_blocks=blocks, name="prefill", **p),
                EngineGeometry.build(model, num_blocks=blocks, name="decode", **d))


GQA = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 64)])
MLA = ModelSpec("mla", [AttentionSpec("mla", "mla", 3, 1, 96)])
HYBRID = ModelSpec("h", [AttentionSpec("mla", "mla", 2, 1, 64),
                         StateSpec("kda", 2, [StateSection("conv", 8, 4, rows=3), StateSection("rec", 4, 256)])])


def _case(name: str) -> tuple[Pair, Request]:
    if name == "pp2xtp2 -> tp4":
        pair = _pair({"tp": 2, "kernel_block_tokens": 16, "topology": Topology(pp=2)},
                     {"tp": 4, "kernel_block_tokens": 8, "layout": "NHD"}, GQA)
    elif name == "tp2 -> pp2xtp1 (3+1 layers)":
        pair = _pair({"tp": 2, "kernel_block_tokens": 8},
                     {"tp": 1, "kernel_block_tokens": 16, "topology": Topology(pp=2, partition=(3, 1))}, GQA)
    elif name == "mla tp2 -> tp4 dcp4":
        pair = _pair({"tp": 2, "kernel_block_tokens": 16},
                     {"tp": 4, "kernel_block_tokens": 8, "topology": Topology(dcp=4, interleave=2)}, MLA)
    elif name == "mla tp4 dcp2 x2 replicas -> pp3xtp1":
        pair = _pair({"tp": 4, "kernel_block_tokens": 8, "topology": Topology(dcp=2, replicas=2)},
                     {"tp": 1, "kernel_block_tokens": 16, "topology": Topology(pp=3)}, MLA)
    else:  # hybrid on shared regions, P PP2 x TP2 -> D TP2 DCP2
        pair = _pair({"tp": 2, "kernel_block_tokens": 8, "blocks_per_logical": 4, "regions": "shared",
                      "topology": Topology(pp=2)},
                     {"tp": 2, "kernel_block_tokens": 8, "blocks_per_logical": 4, "regions": "shared",
                      "topology": Topology(dcp=2)}, HYBRID)
        return pair, fresh_request(pair, 70, decode_tokens=71, prefill_first_block=1, decode_first_block=2)
    return pair, fresh_request(pair, 70, prefill_first_block=1, decode_first_block=2)


CASES = ["pp2xtp2 -> tp4", "tp2 -> pp2xtp1 (3+1 layers)", "mla tp2 -> tp4 dcp4", "mla tp4 dcp2 x2 replicas -> pp3xtp1",
         "hybrid pp2xtp2 -> tp2 dcp2"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(("push", "mode"), [(False, "coalesced"), (True, "prepped")])
def test_topology_pairs_land_every_byte(name: str, push: bool, mode: str) -> None:
    pair, request = _case(name)
    out = run_local(pair, request, push=push, mode=mode, device=DEVICE)
    plan: TransferPlan = out["plan"]
    assert out["violations"] == []
    D = pair.decode
    assert out["checked"] == sum(D.regions[i].nbytes for r in range(D.num_ranks) for i in D.rank_regions(r))
    initiators = [r for r in out["results"] if r.kind in ("pull", "push")]
    assert sum(r.bytes_moved for r in initiators) == plan.bytes_copied
    for r in initiators:
        if push:  # a P rank writes to every D rank reading from it, and only its stage's layers
            assert r.nixl_requests == len({int(d) for d in plan.for_prefill_rank(r.rank).d_rank})
        else:  # a D rank reads only from the P ranks holding its layers and tokens
            assert r.nixl_requests == len(plan.sources_of(r.rank))


@pytest.mark.parametrize("chunked", [False, True], ids=["one chunk", "chunks"])
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("name", CASES)
def test_topology_pairs_packed(name: str, push: bool, chunked: bool) -> None:
    """Packed plans (docs/design.md §12) on every topology case: each rank packs or unpacks only its
    stage's regions; one descriptor per wire row; every D byte checked."""
    pair, request = _case(name)
    plan = pair.plan(request, strategy="packed")
    if chunked:
        busiest = max(int(plan.staging_used(side).max()) for side in ("prefill", "decode"))
        plan = pair.plan(request, strategy="packed", staging_bytes=max(min_staging_bytes(pair, request), busiest // 3))
    assert plan.packed and (len(plan.chunks) > 1) == chunked
    out = run_local(pair, request, push=push, device=DEVICE, plan=plan)
    assert out["violations"] == [], [str(v) for v in out["violations"]]
    D = pair.decode
    assert out["checked"] == sum(D.regions[i].nbytes for r in range(D.num_ranks) for i in D.rank_regions(r))
    initiators = [r for r in out["results"] if r.kind in ("pull", "push")]
    assert sum(r.bytes_moved for r in initiators) == plan.wire.total_bytes == plan.bytes_copied
    assert sum(r.descriptors for r in initiators) == len(plan.wire)
    w = plan.wire
    for r in initiators:  # each initiator talks only to the ranks its wire rows name
        mine = (w.p_rank if push else w.d_rank) == r.rank
        assert r.nixl_requests <= len(plan.chunks) * len(set((w.d_rank if push else w.p_rank)[mine].tolist()))


def test_each_stage_registers_and_advertises_only_its_regions() -> None:
    pair, request = _case("pp2xtp2 -> tp4")
    P = pair.prefill
    assert P.rank_regions(0) == (0, 1) and P.rank_regions(3) == (2, 3)  # per_layer: region L = layer L
    caches = allocate_caches(P, DEVICE)
    assert caches[3][0].numel() == 0 and caches[3][2].numel() == P.regions[2].nbytes
    with pytest.raises(RegistrationError, match="pipeline stage holds"):
        Endpoint(P, "prefill", 3, caches[3])  # every region's buffer, not the stage's two
    with Endpoint(P, "prefill", 3, rank_buffers(P, caches, 3)) as ep:
        assert len(ep.info().regions) == 2
        assert decode_rank(ep.handshake()).region_ids == (2, 3)
    # stages of 3 and 1 layers: stage 1's single region advertised as stage 0's rank is refused
    pair2, _ = _case("tp2 -> pp2xtp1 (3+1 layers)")
    D = pair2.decode
    with Endpoint(D, "decode", 1, rank_buffers(D, allocate_caches(D, DEVICE), 1)) as ep:
        forged = ep.handshake().replace(b'"rank":1', b'"rank":0')
        with pytest.raises(HandshakeError, match=r"1 regions advertised for rank 0, whose pipeline stage holds 3"):
            decode_rank(forged)


def test_a_row_naming_another_stages_region_fails_before_posting() -> None:
    pair, request = _case("pp2xtp2 -> tp4")
    plan = plan_pair(pair, request)
    c = plan.copies
    stage1 = c.p_rank >= 2
    # read stage 1's layers from the stage 0 rank with the same tp rank: regions 2, 3 are not on it
    bad = Copies(c.p_rank - 2 * stage1, c.p_region, c.p_offset, c.d_rank, c.d_region, c.d_offset, c.nbytes)
    evil = TransferPlan(plan.prefill_tp, plan.decode_tp, bad, plan.zeros, prefill_ranks=plan.prefill_ranks,
                        decode_ranks=plan.decode_ranks)
    p_caches, d_caches = allocate_caches(pair.prefill, DEVICE), allocate_caches(pair.decode, DEVICE)
    fill_caches(pair, request, p_caches, d_caches)
    with LocalDeployment(pair, p_caches, d_caches) as dep:
        before = [t.clone() for t in rank_buffers(pair.decode, d_caches, 0)]
        t = dep.d_links[0].pull("evil", request, plan=evil)
        with pytest.raises(TransferFailed) as ei:
            t.poll()
        assert ei.value.reason == "plan_error" and "leave region" in str(ei.value)
        assert all(a.equal(b) for a, b in zip(before, rank_buffers(pair.decode, d_caches, 0), strict=True))
        dep.run("good", request, plan, timeout_s=20)  # the link is not poisoned
    assert check_caches(pair, request, d_caches)[0] == []
