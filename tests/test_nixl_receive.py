"""The torch receive steps agree byte for byte with the simulator's numpy on random inputs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

import torch  # noqa: E402

from kvgeom import AttentionSpec, Copies, EngineGeometry, Memory, ModelSpec, PlanError, Rearrange, TransferPlan, Zeros  # noqa: E402
from kvgeom.checking import apply_plan  # noqa: E402
from kvgeom.lowering import zero_rows  # noqa: E402
from kvgeom_nixl.receive import apply_receive_steps  # noqa: E402


def _device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(name)


def _engine(page_tokens: int, regions: int) -> EngineGeometry:
    # per-layer regions; page = 2 planes * 2 heads * K tokens * 32 B
    m = ModelSpec("m", [AttentionSpec("a", "full", regions, 2, 32)])
    return EngineGeometry.build(m, tp=1, kernel_block_tokens=page_tokens, num_blocks=6)


def _random_rearrange(rng: np.random.Generator, region: int, page_bytes: int, num_pages: int) -> Rearrange:
    """A permutation of ``prod(shape)`` elements of ``unit`` bytes inside each listed page: the
    source and destination are two dense orders of the same axes, at two offsets."""
    while True:
        unit = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        shape = tuple(int(x) for x in rng.integers(1, 5, size=int(rng.integers(1, 4))))
        total = int(np.prod(shape)) * unit
        if total <= page_bytes:
            break

    def dense(order: np.ndarray) -> tuple[int, ...]:
        strides = [0] * len(shape)
        step = unit
        for ax in order[::-1]:
            strides[ax] = step
            step *= shape[ax]
        return tuple(strides)

    src = dense(rng.permutation(len(shape)))
    dst = dense(rng.permutation(len(shape)))
    room = page_bytes - total
    pages = tuple(int(p) for p in rng.choice(num_pages, size=int(rng.integers(1, num_pages + 1)), replace=False))
    return Rearrange(0, region, pages, shape, src, dst, unit, int(rng.integers(0, room + 1)),
                     int(rng.integers(0, room + 1)), page_bytes=page_bytes)


def _random_zeros(rng: np.random.Generator, sizes: list[int]) -> Zeros:
    rows = []
    for _ in range(int(rng.integers(1, 12))):
        region = int(rng.integers(0, len(sizes)))
        grain = int(rng.choice([1, 8, 64, 256]))
        start = int(rng.integers(0, sizes[region] // grain)) * grain
        n = int(rng.integers(1, (sizes[region] - start) // grain + 1)) * grain
        rows.append((0, region, start, n))
    a = np.array(rows, np.int64).reshape(-1, 4)
    return Zeros(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def _one_case(seed: int, dev: torch.device) -> None:
    rng = np.random.default_rng(seed)
    engine = _engine(int(rng.choice([4, 8, 16])), int(rng.integers(1, 4)))
    sizes = [r.nbytes for r in engine.regions]
    rearranges = tuple(_random_rearrange(rng, int(rng.integers(0, len(sizes))), engine.regions[0].page_bytes,
                                         engine.regions[0].num_pages) for _ in range(int(rng.integers(1, 4))))
    zeros = _random_zeros(rng, sizes)
    plan = TransferPlan(1, 1, Copies.empty(), zeros, rearranges)
    start = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]

    expected = Memory.wrap(engine, [[b.copy() for b in start]])
    apply_plan(plan, Memory.allocate(engine), expected)
    assert any(not np.array_equal(s, w) for s, w in zip(start, expected.buffers[0], strict=True))

    views = [torch.from_numpy(b.copy()).to(dev) for b in start]
    event = apply_receive_steps(views, rearranges, zeros,
                                stream=torch.cuda.Stream(dev) if dev.type == "cuda" else None)
    if event is not None:
        event.synchronize()
    for got, want in zip(views, expected.buffers[0], strict=True):
        assert np.array_equal(got.cpu().numpy(), want), seed


@pytest.mark.parametrize("path", ["sliced", "batched"])
@pytest.mark.parametrize("seed", range(20))
def test_torch_receive_steps_match_the_simulator(seed: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random rearranges (permutations of units inside pages) then random zeros, on random bytes:
    through strided page runs and per-row slices, or (forced) through the batched index ops."""
    import kvgeom_nixl.receive as receive

    if path == "batched":
        monkeypatch.setattr(receive, "MAX_STRIDED_RUNS", 0)
        monkeypatch.setattr(receive, "MAX_SLICED_ROWS", 0)
    _one_case(seed, torch.device("cpu"))


def test_torch_receive_steps_match_the_simulator_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvgeom_nixl.receive as receive

    dev = _device("cuda")
    for seed in range(20):
        _one_case(seed, dev)
    monkeypatch.setattr(receive, "MAX_STRIDED_RUNS", 0)
    monkeypatch.setattr(receive, "MAX_SLICED_ROWS", 0)
    for seed in range(20):
        _one_case(seed, dev)


def test_zero_rows_worked_number() -> None:
    # rows (1024, 512) and (4096, 256) of an 8192-byte region: g = gcd(1024, 4096, 512, 256, 8192) = 256,
    # 256-byte rows 1024/256 = 4, 5 (512 B = 2 rows) and 4096/256 = 16 (1 row)
    zeros = Zeros([0, 0], [0, 0], [1024, 4096], [512, 256])
    rows = zero_rows(zeros, 0, 8192)
    assert rows.grain == 256 and rows.index().tolist() == [4, 5, 16]
    import kvgeom_nixl.receive as receive

    for limit in (64, 0):  # per-row slices, then the batched index
        receive.MAX_SLICED_ROWS, saved = limit, receive.MAX_SLICED_ROWS
        try:
            view = torch.full((8192,), 7, dtype=torch.uint8)
            apply_receive_steps([view], (), zeros)
        finally:
            receive.MAX_SLICED_ROWS = saved
        assert view[1024:1536].eq(0).all() and view[4096:4352].eq(0).all()
        assert int(view.ne(0).sum()) == 8192 - 768


def test_rearrange_worked_number_nhd_to_hnd() -> None:
    # plan.py's example: 2 heads x 4 tokens of 8 B, NHD (head stride 8, token 16) -> HND (32, 8)
    page = torch.arange(64, dtype=torch.uint8)
    r = Rearrange(0, 0, (0,), (2, 4), (8, 16), (32, 8), 8, page_bytes=64)
    apply_receive_steps([page], (r,), Zeros.empty())
    # head h token t moved from 8h + 16t to 32h + 8t
    for h in range(2):
        for t in range(4):
            assert page[32 * h + 8 * t: 32 * h + 8 * t + 8].tolist() == list(range(8 * h + 16 * t, 8 * h + 16 * t + 8))


def test_receive_steps_refuse_rows_outside_the_region() -> None:
    view = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(PlanError, match="ends at byte 1280 of a 1024 B region"):
        apply_receive_steps([view], (), Zeros([0], [0], [1024], [256]))
    r = Rearrange(0, 0, (3,), (2,), (8,), (16,), 8, page_bytes=512)
    with pytest.raises(PlanError, match="reach byte 1560"):
        apply_receive_steps([view], (r,), Zeros.empty())
    with pytest.raises(PlanError, match="raw VRAM pointer"):
        apply_receive_steps([None], (), Zeros([0], [0], [0], [8]))
