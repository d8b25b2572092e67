"""The executor with real NIXL agents in one process: every D byte checked by the simulator.

Each case fills P with the simulator's coordinate hashes and D with its stale pattern, plans with
the planner, runs the plan through NIXL (pull or push, coalesced or prepped lowering), applies the
receive steps with torch and compares every D byte with ``kvgeom.checking.check_decode``.
Set ``KVGEOM_DEVICE=cuda`` to run the same cases on VRAM (scripts/gpu-check).
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

import torch  # noqa: E402

from kvgeom import (  # noqa: E402
    AttentionSpec,
    EngineGeometry,
    ModelSpec,
    NoteKind,
    Pair,
    Request,
    TransferPlan,
    fresh_request,
    plan_pair,  # noqa: E402
    tile_bytes,  # noqa: E402
)
from kvgeom.building import get_preset  # noqa: E402
from kvgeom_nixl import Endpoint, wait_all  # noqa: E402
from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches  # noqa: E402
from kvgeom_nixl.testing import requested_device, run_local  # noqa: E402

DEVICE = requested_device()


def _model(heads: int = 4, head_bytes: int = 128, layers: int = 2) -> ModelSpec:
    return ModelSpec("m", [AttentionSpec("attn", "full", layers, heads, head_bytes)])


def _pair(p: dict[str, Any], d: dict[str, Any], *, blocks: int = 12, model: ModelSpec | None = None) -> Pair:
    m = model or _model()
    return Pair(EngineGeometry.build(m, num_blocks=blocks, name="prefill", **p),
                EngineGeometry.build(m, num_blocks=blocks, name="decode", **d))


def _case(name: str) -> tuple[Pair, Request]:
    if name == "tp1->tp2 hnd k16":
        pair = _pair({"tp": 1, "kernel_block_tokens": 16}, {"tp": 2, "kernel_block_tokens": 16})
        return pair, fresh_request(pair, 150, prefill_first_block=1, decode_first_block=2)
    if name == "tp2->tp1 hnd k16":
        pair = _pair({"tp": 2, "kernel_block_tokens": 16}, {"tp": 1, "kernel_block_tokens": 16})
        return pair, fresh_request(pair, 150, prefill_first_block=2, decode_first_block=1)
    if name == "k16 nhd -> k8 hnd":
        pair = _pair({"tp": 1, "kernel_block_tokens": 16, "layout": "NHD"},
                     {"tp": 1, "kernel_block_tokens": 8, "layout": "HND"}, blocks=24)
        return pair, fresh_request(pair, 77, prefill_first_block=3, decode_first_block=5)
    if name == "k8 hnd split -> k16 nhd inner, prefix":
        pair = _pair({"tp": 2, "kernel_block_tokens": 8, "kv": "split"},
                     {"tp": 1, "kernel_block_tokens": 16, "layout": "NHD", "kv": "inner"}, blocks=24)
        return pair, fresh_request(pair, 90, prefix_hit_tokens=32)
    preset, tokens, layers = {
        "preset gqa-tp2-tp4": ("gqa-tp2-tp4", None, None),
        "preset qwen-swa-tp2-tp4 (sliding)": ("qwen-swa-tp2-tp4", 300, 2),
        "preset deepseek-v3 mla tp8->tp1": ("deepseek-v3-tp8-tp1", 100, 2),
        "preset nemotron-h tp1->tp4 (hybrid)": ("nemotron-h-tp1-tp4", 100, 1),
        "preset qwen3-next tp2->tp4 (hybrid)": ("qwen3-next-tp2-tp4", 100, 1),
        "preset kimi-linear tp8->tp1 (hybrid)": ("kimi-linear-tp8-tp1", 1000, 1),
    }[name]
    return get_preset(preset).build(tokens, prefix=0, layers=layers)


CASES = ["tp1->tp2 hnd k16", "tp2->tp1 hnd k16", "k16 nhd -> k8 hnd", "k8 hnd split -> k16 nhd inner, prefix",
         "preset gqa-tp2-tp4", "preset qwen-swa-tp2-tp4 (sliding)", "preset deepseek-v3 mla tp8->tp1",
         "preset nemotron-h tp1->tp4 (hybrid)", "preset qwen3-next tp2->tp4 (hybrid)",
         "preset kimi-linear tp8->tp1 (hybrid)"]


def _check(out: dict[str, Any], pair: Pair, mode: str, push: bool) -> None:
    plan: TransferPlan = out["plan"]
    assert out["violations"] == [], [str(v) for v in out["violations"]]
    assert out["checked"] == pair.decode.tp * sum(r.nbytes for r in pair.decode.regions)
    results = out["results"]
    initiators = [r for r in results if r.kind == ("push" if push else "pull")]
    passive = [r for r in results if r.kind == ("accept_push" if push else "serve_pull")]
    assert len(initiators) == (pair.prefill.tp if push else pair.decode.tp)
    assert len(passive) == (pair.decode.tp if push else pair.prefill.tp)
    assert sum(r.bytes_moved for r in initiators) == plan.bytes_copied
    # NIXL's own count after merging equals the plan's copies (or wire rows) in both modes: the plan
    # is minimal, so the tiles of one copy merge back into one descriptor and two copies never merge.
    assert sum(r.nixl_descs for r in initiators) == plan.descriptors
    if mode == "coalesced" or plan.packed:  # packed plans post their wire rows as coalesced lists
        assert sum(r.descriptors for r in initiators) == plan.descriptors
    else:
        assert sum(r.descriptors for r in initiators) == plan.bytes_copied // tile_bytes(pair)
    decode_side = [r for r in results if r.role == "decode"]
    assert sum(r.bytes_zeroed for r in decode_side) == plan.bytes_zeroed
    if push:
        for r in results:
            if r.kind == "push":
                assert r.bytes_moved == plan.packed_for_prefill_rank(r.rank).bytes_copied


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("case", CASES)
def test_transfer_lands_every_byte(case: str, push: bool, mode: str) -> None:
    pair, request = _case(case)
    out = run_local(pair, request, push=push, mode=mode, device=DEVICE, telemetry=True)
    assert out["plan"].bytes_copied > 0
    _check(out, pair, mode, push)


RANK_CASES = ["tp2->tp1 hnd k16", "k8 hnd split -> k16 nhd inner, prefix", "preset qwen-swa-tp2-tp4 (sliding)",
              "preset deepseek-v3 mla tp8->tp1", "preset kimi-linear tp8->tp1 (hybrid)"]


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("case", RANK_CASES)
def test_links_plan_their_own_rank_on_the_compiled_pair(case: str, push: bool, mode: str) -> None:
    """No plan given: every link plans its own rank's part on the compiled pair (docs/design.md §13)
    and, in mode prepped, lowers it to table indices straight from the compiled blocks."""
    pair, request = _case(case)
    plan = plan_pair(pair, request)
    p_caches = allocate_caches(pair.prefill, DEVICE)
    d_caches = allocate_caches(pair.decode, DEVICE)
    fill_caches(pair, request, p_caches, d_caches)
    with LocalDeployment(pair, p_caches, d_caches, telemetry=True) as dep:
        results = dep.run("r", request, None, push=push, mode=mode)
        for link in dep.d_links + dep.p_links:
            assert link.pair.compile().plan(request) == plan  # each link's own compiled pair
    violations, checked = check_caches(pair, request, d_caches)
    _check({"plan": plan, "results": results, "violations": violations, "checked": checked}, pair, mode, push)


STAGED_CASES = ["k16 nhd -> k8 hnd", "k8 hnd tp2 -> k16 nhd tp1"]


def _staged_case(name: str) -> tuple[Pair, Request]:
    if name == "k16 nhd -> k8 hnd":
        return _case(name)
    pair = _pair({"tp": 2, "kernel_block_tokens": 8, "layout": "HND"},
                 {"tp": 1, "kernel_block_tokens": 16, "layout": "NHD"}, blocks=16)
    return pair, fresh_request(pair, 100, prefill_first_block=1, decode_first_block=3)


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("case", STAGED_CASES)
def test_staged_plan_with_rearranges(case: str, push: bool, mode: str) -> None:
    """Staged strategy: P pages land whole in P's order, then a rearrange per D page fixes the
    layout with torch; fewer, larger descriptors than direct for the same request."""
    from kvgeom import STRATEGIES

    if "staged" not in STRATEGIES:
        pytest.skip("the planner has no staged strategy")
    pair, request = _staged_case(case)
    plan = plan_pair(pair, request, strategy="staged")
    assert plan.rearranges, plan.notes
    out = run_local(pair, request, push=push, mode=mode, device=DEVICE, telemetry=True, plan=plan)
    _check(out, pair, mode, push)
    receivers = [r for r in out["results"] if r.role == "decode"]
    assert sum(r.rearranges for r in receivers) == len(plan.rearranges)
    assert len(plan.copies) < len(plan_pair(pair, request).copies)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_caller_tensors_are_kept_as_they_are(device: str) -> None:
    """Registration and transfer never replace, permute or re-lay the caller's tensors."""
    dev = requested_device(device)
    pair = _pair({"tp": 1, "kernel_block_tokens": 16}, {"tp": 1, "kernel_block_tokens": 8, "layout": "NHD"})
    request = fresh_request(pair, 60, decode_first_block=1)
    # typed, shaped caches as an attention backend allocates them: [pages, kv, heads, tokens, head_dim] fp16
    p_caches = [[torch.empty(12, 2, 4, 16, 64, dtype=torch.float16, device=dev) for _ in range(2)]]
    d_caches = [[torch.empty(12, 2, 8, 4, 64, dtype=torch.float16, device=dev) for _ in range(2)]]  # NHD K=8
    before = [(t, t.data_ptr(), t.shape, t.stride(), t.dtype) for regs in p_caches + d_caches for t in regs]
    fill_caches(pair, request, _flat(p_caches), _flat(d_caches))
    with LocalDeployment(pair, p_caches, d_caches) as dep:
        assert dep.d[0].memory.owners[0] is d_caches[0][0]
        dep.run("r", request, plan_pair(pair, request))
        after = [(t, t.data_ptr(), t.shape, t.stride(), t.dtype) for regs in p_caches + d_caches for t in regs]
        for (t0, *a), (t1, *b) in zip(before, after, strict=True):
            assert t0 is t1 and a == b and t1.is_contiguous()
    violations, _ = check_caches(pair, request, _flat(d_caches))
    assert violations == []
    assert all(o is None for o in dep.d[0].memory.regions) or dep.d[0].memory.regions == ()


def _flat(caches: list[list[Any]]) -> list[list[Any]]:
    return [[t.reshape(-1).view(torch.uint8) for t in regs] for regs in caches]


def test_two_requests_back_to_back_reuse_tables_and_links() -> None:
    pair, _ = _case("tp2->tp1 hnd k16")
    r1 = fresh_request(pair, 40, prefill_first_block=0, decode_first_block=0)
    r2 = fresh_request(pair, 70, prefill_first_block=4, decode_first_block=6)
    p_caches = allocate_caches(pair.prefill, DEVICE)
    d_caches = allocate_caches(pair.decode, DEVICE)
    with LocalDeployment(pair, p_caches, d_caches) as dep:
        fill_caches(pair, r1, p_caches, d_caches)  # the registered memory is refilled in place
        dep.run("r1", r1, plan_pair(pair, r1), mode="prepped")
        assert check_caches(pair, r1, d_caches)[0] == []
        tables = dep.d[0].rank_agent.prepared_tables()
        fill_caches(pair, r2, p_caches, d_caches)
        dep.run("r2", r2, plan_pair(pair, r2), mode="prepped")
        assert check_caches(pair, r2, d_caches)[0] == []
        # prepared once per (agent, tile): D's own table and one per P rank, then reused (same handles)
        tile = dep.d_links[0].tile_bytes
        assert sorted(tables) == sorted([("", tile)] + [(p.name, tile) for p in dep.p])
        assert dep.d[0].rank_agent.prepared_tables() == tables
        assert all(not ep.pending_notifications() for ep in dep.endpoints)


def _merge_fills(pair: Pair, requests: list[Request], device: str) -> tuple[list[list[Any]], list[list[Any]]]:
    """P caches holding every request's P fill in that request's listed pages (D's fill is shared)."""
    from kvgeom.checking import listed_pages

    p_caches = allocate_caches(pair.prefill, device)
    d_caches = allocate_caches(pair.decode, device)
    scratch = allocate_caches(pair.prefill, "cpu")
    fill_caches(pair, requests[0], p_caches, d_caches)
    for req in requests[1:]:
        fill_caches(pair, req, scratch, allocate_caches(pair.decode, "cpu"))
        for region, mask in listed_pages(pair.prefill, req, "prefill").items():
            page = pair.prefill.regions[region].page_bytes
            rows = torch.as_tensor(mask).repeat_interleave(page)
            for rank in range(pair.prefill.tp):
                dst = p_caches[rank][region]
                dst[rows.to(dst.device)] = scratch[rank][region][rows].to(dst.device)
    return p_caches, d_caches


def _check_alone(pair: Pair, request: Request, others: list[Request], d_caches: list[list[Any]]) -> list[Any]:
    """check_decode for ``request`` after restoring the other requests' D pages to D's fill."""
    from kvgeom.checking import listed_pages

    fresh_p = allocate_caches(pair.prefill, "cpu")
    fresh_d = allocate_caches(pair.decode, "cpu")
    fill_caches(pair, request, fresh_p, fresh_d)
    view = [[t.cpu().clone() for t in regs] for regs in d_caches]
    for other in others:
        for region, mask in listed_pages(pair.decode, other, "decode").items():
            rows = torch.as_tensor(mask).repeat_interleave(pair.decode.regions[region].page_bytes)
            for rank in range(pair.decode.tp):
                view[rank][region][rows] = fresh_d[rank][region][rows]
    return check_caches(pair, request, view)[0]


def test_transfers_of_two_requests_in_flight_together() -> None:
    """A pull and a push of two requests posted together on the same links, then driven together."""
    pair, _ = _case("tp1->tp2 hnd k16")
    ra = fresh_request(pair, 40, prefill_first_block=0, decode_first_block=0)
    rb = fresh_request(pair, 50, prefill_first_block=5, decode_first_block=5)
    p_caches, d_caches = _merge_fills(pair, [ra, rb], DEVICE)
    with LocalDeployment(pair, p_caches, d_caches) as dep:
        ts = dep.post("a", ra, plan_pair(pair, ra)) + dep.post("b", rb, plan_pair(pair, rb), push=True, mode="prepped")
        results = wait_all(ts, peers=dep.endpoints)
        assert sorted(r.request_id for r in results) == ["a"] * 3 + ["b"] * 3
    assert _check_alone(pair, ra, [rb], d_caches) == []
    assert _check_alone(pair, rb, [ra], d_caches) == []


def test_raw_pointers_and_numpy_buffers_register() -> None:
    import numpy as np

    pair, request = _case("tp1->tp2 hnd k16")
    p_caches = allocate_caches(pair.prefill, "cpu")
    d_caches = allocate_caches(pair.decode, "cpu")
    fill_caches(pair, request, p_caches, d_caches)
    p_raw = [(t.data_ptr(), t.numel()) for t in p_caches[0]]  # P as raw (pointer, nbytes)
    d_np = [[t.numpy() for t in regs] for regs in d_caches]   # D as numpy arrays (same memory)
    p = [Endpoint(pair.prefill, "prefill", 0, p_raw, mem_type="DRAM", device=0)]
    d = [Endpoint(pair.decode, "decode", r, d_np[r]) for r in range(2)]
    try:
        links = [e.connect([p[0].handshake()]) for e in d]
        p_link = p[0].connect([e.handshake() for e in d])
        plan = plan_pair(pair, request)
        ts = [lk.pull("x", request, plan=plan) for lk in links] + [p_link.serve_pull("x", request, plan=plan)]
        wait_all(ts, peers=p + d)
    finally:
        for e in p + d:
            e.close()
    violations, _ = check_caches(pair, request, d_caches)
    assert violations == [] and np.shares_memory(d_np[0][0], d_caches[0][0].numpy())


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
@pytest.mark.parametrize("seed", range(4))
def test_hand_built_plans_match_the_simulators_apply_plan(seed: int, mode: str) -> None:
    """Arbitrary plans (random copies with disjoint D ranges, random zeros) on random bytes: NIXL +
    torch must leave D exactly as kvgeom.checking.apply_plan's numpy does. Odd seeds use byte
    offsets off the tile grid, so mode "prepped" must fall back to coalesced descriptors."""
    import numpy as np

    from kvgeom import Copies, Memory, Zeros
    from kvgeom.checking import apply_plan

    rng = np.random.default_rng(seed)
    pair = _pair({"tp": 2, "kernel_block_tokens": 16}, {"tp": 2, "kernel_block_tokens": 8, "layout": "NHD"}, blocks=4)
    tile = tile_bytes(pair)
    grain = tile if seed % 2 == 0 else 1
    rows, zrows = [], []
    for d_rank in range(2):
        for d_region, reg in enumerate(pair.decode.regions):
            cuts = np.sort(rng.choice(reg.nbytes // grain, size=8, replace=False)) * grain
            for lo, hi in zip(cuts[0::2], cuts[1::2], strict=True):  # disjoint D ranges [lo, hi)
                n = int(hi - lo)
                p_region = int(rng.integers(0, len(pair.prefill.regions)))
                p_off = int(rng.integers(0, (pair.prefill.regions[p_region].nbytes - n) // grain + 1)) * grain
                rows.append((int(rng.integers(0, 2)), p_region, p_off, d_rank, d_region, int(lo), n))
            zrows.append((d_rank, d_region, int(cuts[-1]), int(reg.nbytes - cuts[-1])))
    a = np.array(rows, np.int64)
    z = np.array(zrows, np.int64)
    plan = TransferPlan(2, 2, Copies(*(a[:, i] for i in range(7))), Zeros(*(z[:, i] for i in range(4))))
    p_caches = allocate_caches(pair.prefill, DEVICE)
    d_caches = allocate_caches(pair.decode, DEVICE)
    p_np = [[rng.integers(0, 256, t.numel(), dtype=np.uint8) for t in regs] for regs in p_caches]
    d_np = [[rng.integers(0, 256, t.numel(), dtype=np.uint8) for t in regs] for regs in d_caches]
    for caches, arrays in ((p_caches, p_np), (d_caches, d_np)):
        for regs, arrs in zip(caches, arrays, strict=True):
            for t, arr in zip(regs, arrs, strict=True):
                t.copy_(torch.from_numpy(arr))
    expected = Memory.wrap(pair.decode, [[x.copy() for x in regs] for regs in d_np])
    apply_plan(plan, Memory.wrap(pair.prefill, p_np), expected)
    with LocalDeployment(pair, p_caches, d_caches) as dep:
        results = dep.run("hand", None, plan, mode=mode)
    for regs, want in zip(d_caches, expected.buffers, strict=True):
        for t, w in zip(regs, want, strict=True):
            assert np.array_equal(t.cpu().numpy(), w)
    pulls = [r for r in results if r.kind == "pull"]
    fell_back = [r for r in pulls if any(n.kind is NoteKind.PREPPED_FALLBACK for n in r.notes)]
    if mode == "prepped" and grain == 1:
        assert fell_back and all(r.mode == "coalesced" for r in fell_back)
    else:
        assert not fell_back and all(r.mode == mode for r in pulls)


def _sweep_cases() -> list[Any]:
    from test_sweep import CASES as SWEEP  # the planner's sweep geometries (tests/ is on sys.path)

    return list(SWEEP)


@pytest.mark.parametrize("strategy", ["direct", "auto"])
@pytest.mark.parametrize("case", _sweep_cases(), ids=lambda c: c.name)
def test_sweep_geometries_pull_with_real_nixl(case: Any, strategy: str) -> None:
    """Every geometry pair of the attention sweep, pulled with NIXL at a length past a few block
    boundaries, D bytes checked by the simulator."""
    from test_sweep import build

    M = case.lengths[len(case.lengths) * 2 // 3]
    pair, _ = build(case, M)
    request = fresh_request(pair, M, decode_tokens=M + 1)
    out = run_local(pair, request, push=False, mode="coalesced", device=DEVICE, telemetry=True,
                    plan=pair.plan(request, strategy=strategy))
    _check(out, pair, "coalesced", False)
