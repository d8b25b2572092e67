"""One rank's staging buffer (a ring of slots) and the torch ops that pack into it and unpack from it
(docs/design.md §12.5). No geometry here: every view and index comes from :mod:`kvgeom.lowering`.

    StagingBuffer(slots x slot_bytes)   host: numpy memory (huge pages), CUDA: torch.empty on the device
      | slot 0 | slot 1 | ... |          a slot belongs to one (request id, chunk) at a time
      .acquire(owner) -> slot | None     .release(slot)   .waiting / .serve_waiting()  (D: grants in order)
    run_steps(steps, regions, buffer, slot, pack=True)    pack: cache -> slot;  pack=False: slot -> cache
      few page runs:   staging.as_strided(run).copy_(cache.as_strided(run))       (kvgeom.lowering.staged_runs)
      scattered pages: rows = staged_rows(step); slot_rows[s_idx] = cache_rows[c_idx]   (index gather/scatter)

A slot of a failed transfer stays owned while a peer or a NIXL request may still touch it: the
transfer releases it once its fence clears (docs/design.md §12.5); no timer frees a slot.

On host memory the copies run with one torch thread (:func:`host_copies`): on the project's 2-core
VM torch's intra-op threads turn an 80 KiB ``copy_`` into 8-12 ms of thread wake-ups, against 2 us
on one thread (a memory copy gains nothing from a second core that shares the memory bus).

Worked number: ``StagingBuffer(memory, slot_bytes=1 << 20, slots=2)`` registers 2 MiB; slot 1 starts
at byte 1,048,576, and a wire row at slot offset 4096 of slot 1 is NIXL address ``base + 1052672``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvgeom import EngineGeometry, StagingStep, value_text
from kvgeom.lowering import staged_rows, staged_runs
from kvgeom.values import check_int

from .errors import ExecutorError
from .handshake import MAX_SLOTS
from .memory import RankMemory

__all__ = ["StagingBuffer", "run_steps", "DEFAULT_SLOTS", "host_copies", "staging_bytes_for", "MAX_AUTO_SLOT_BYTES",
           "MIN_AUTO_SLOT_BYTES"]

DEFAULT_SLOTS = 2  # pack chunk i + 1 while chunk i is on the wire
MAX_AUTO_SLOT_BYTES = 64 << 20  # staging_bytes_for's cap: a longer request moves in more chunks
MIN_AUTO_SLOT_BYTES = 1 << 20


def staging_bytes_for(engine: EngineGeometry, rank: int, max_tokens: int, *, cap: int = MAX_AUTO_SLOT_BYTES,
                      floor: int = MIN_AUTO_SLOT_BYTES) -> int:
    """A staging slot for rank ``rank`` of ``engine`` (``Endpoint(staging_bytes=...)``): what the
    rank holds of ``max_tokens`` tokens (every region's logical page per logical block, so a state
    group counts a page per block, an over-estimate), between ``floor`` and ``cap``, in whole 4 KiB
    pages. A request of up to ``max_tokens`` tokens then packs in one chunk per slot when it fits
    ``cap``, and a longer one in more chunks (a packed plan is cut to the slot, docs/design.md §12.3).

    Worked number: the e2e tiny Llama (2 layers, 4 KV heads of 32 float32 dims, blocks of 32
    tokens: a logical page of 2 x 4 x 32 x 32 x 4 = 32 KiB per layer, 2 KiB a token) at
    ``max_tokens=2048``: 4 MiB; a Llama-8B-like rank (32 layers, 8 heads of 128, float32, 256 KiB
    a token) at 16384 tokens: 4 GiB, capped at 64 MiB."""
    rank = check_int("rank", rank, minimum=0, error=ExecutorError)
    if rank >= engine.num_ranks:
        raise ExecutorError("rank", f"rank {rank} of an engine of {engine.num_ranks} ranks", actual=rank,
                            expected=f"< {engine.num_ranks}", fix="pass this worker's rank")
    max_tokens = check_int("max_tokens", max_tokens, minimum=1, error=ExecutorError)
    per_block = sum(engine.logical_page_bytes(r) for r in engine.rank_regions(rank))
    want = -(-per_block * max_tokens // engine.logical_block_tokens)
    return -(-min(max(want, floor), cap) // 4096) * 4096


class StagingBuffer:
    """``slots`` slots of ``slot_bytes`` on the device of ``memory`` (the rank's cache)."""

    def __init__(self, memory: RankMemory, slot_bytes: int, slots: int = DEFAULT_SLOTS) -> None:
        slot_bytes = check_int("staging_bytes", slot_bytes, minimum=1, error=ExecutorError)
        slots = check_int("staging_slots", slots, minimum=2, error=ExecutorError)
        if slots > MAX_SLOTS:
            raise ExecutorError("staging_slots", f"a ring of {value_text(slots)} slots (at most {MAX_SLOTS})",
                                actual=slots, expected=f"2 <= slots <= {MAX_SLOTS}", fix="pass staging_slots=2 or more")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.nbytes = slot_bytes * slots
        device = memory.device()
        try:
            if device.type == "cpu":  # numpy asks the kernel for transparent huge pages on large arrays
                self.tensor = torch.from_numpy(np.empty(self.nbytes, np.uint8))
            else:
                self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        except (MemoryError, ValueError, RuntimeError) as e:  # torch's out-of-memory is a RuntimeError
            raise ExecutorError("staging_bytes", f"cannot allocate {slots} x {value_text(slot_bytes)} B of staging on "
                                f"{device}: {type(e).__name__}", actual=self.nbytes,
                                fix="pass a smaller staging_bytes (the planner's chunk capacity)") from e
        self.addr = int(self.tensor.data_ptr())
        self.device_id = 0 if device.type == "cpu" else int(device.index or 0)
        self.owner: list[tuple[str, int] | None] = [None] * slots
        self.waiting: deque[tuple[Any, int]] = deque()  # (packed transfer, chunk) waiting for a D slot, in order

    def desc(self) -> tuple[int, int, int]:
        """``(addr, nbytes, device)`` as NIXL registers it."""
        return self.addr, self.nbytes, self.device_id

    def base(self, slot: int) -> int:
        """Byte offset of ``slot`` in the buffer."""
        return slot * self.slot_bytes

    def view(self, slot: int) -> torch.Tensor:
        return self.tensor[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def acquire(self, owner: tuple[str, int]) -> int | None:
        """A free slot for ``owner`` (request id, chunk), or None when every slot is taken."""
        for s, o in enumerate(self.owner):
            if o is None:
                self.owner[s] = owner
                return s
        return None

    def release(self, slot: int) -> None:
        self.owner[slot] = None

    def serve_waiting(self) -> None:
        """Grant slots to the queued chunks, first come first served (a head that finds no slot waits)."""
        while self.waiting:
            t, index = self.waiting[0]
            if not t.grant(index):
                return
            self.waiting.popleft()

    def free(self) -> int:
        """Slots not owned (a failed transfer keeps a slot owned until its fence clears)."""
        return sum(o is None for o in self.owner)

    def owned_by(self, request_id: str) -> list[int]:
        return [s for s, o in enumerate(self.owner) if o is not None and o[0] == request_id]

    def __repr__(self) -> str:
        return f"StagingBuffer({self.slots} x {self.slot_bytes} B, {self.free()} free)"


@contextlib.contextmanager
def host_copies(device: torch.device) -> Iterator[None]:
    """Run the enclosed torch copies with one intra-op thread when ``device`` is the host (no-op on
    CUDA); the caller's thread count is restored afterwards."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _strided(view: torch.Tensor, size: tuple[int, ...], strides: tuple[int, ...], start: int) -> torch.Tensor:
    return view.as_strided(size, strides, view.storage_offset() + start)


_WORD = 8  # bytes of the widest element a run is copied in (torch copies 8-byte words faster than bytes)


def _run_views(view: torch.Tensor, slot_view: torch.Tensor, run: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's cache and staging views, in 8-byte words when every size, stride and start allows."""
    quantities = (*run.cache_strides[:-1], *run.staging_strides[:-1], run.size[-1], run.cache_start, run.staging_start,
                  view.storage_offset(), slot_view.storage_offset(), view.numel(), slot_view.numel())
    if all(q % _WORD == 0 for q in quantities):
        size = (*run.size[:-1], run.size[-1] // _WORD)
        cstrides = (*(x // _WORD for x in run.cache_strides[:-1]), 1)
        sstrides = (*(x // _WORD for x in run.staging_strides[:-1]), 1)
        return (_strided(view.view(torch.int64), size, cstrides, run.cache_start // _WORD),
                _strided(slot_view.view(torch.int64), size, sstrides, run.staging_start // _WORD))
    return (_strided(view, run.size, run.cache_strides, run.cache_start),
            _strided(slot_view, run.size, run.staging_strides, run.staging_start))


def run_steps(steps: Sequence[StagingStep], regions: Sequence[Any], buffer: StagingBuffer, slot: int, *,
              pack: bool) -> None:
    """Run pack steps (``pack=True``: cache -> slot) or unpack steps (slot -> cache) on the current
    stream; every element is checked to stay in its region and in the slot first."""
    slot_view = buffer.view(slot)
    with host_copies(slot_view.device):
        _run_steps(steps, regions, buffer, slot_view, pack)


def _run_steps(steps: Sequence[StagingStep], regions: Sequence[Any], buffer: StagingBuffer, slot_view: torch.Tensor,
               pack: bool) -> None:
    sizes = [0 if v is None else int(v.numel()) for v in regions]
    for st in steps:
        runs = staged_runs(st, sizes, buffer.slot_bytes)
        if runs is not None:
            for run in runs:
                view = regions[run.region]
                if view is None:
                    raise ExecutorError(f"region {run.region}", "packed steps need a tensor view of the region",
                                        fix="register that region from a torch tensor")
                cache, staged = _run_views(view, slot_view, run)
                if pack:
                    staged.copy_(cache)
                else:
                    cache.copy_(staged)
            continue
        rows = staged_rows(st, sizes, buffer.slot_bytes)
        slot_rows = slot_view.view(-1, rows.grain)
        for lam in range(len(rows.regions)):
            view = regions[int(rows.regions[lam])]
            cache_rows = view.view(-1, rows.grain)
            c_idx = _to_device(rows.cache_index(lam), view.device)
            s_idx = _to_device(rows.staging_index(lam), view.device)
            if pack:
                slot_rows[s_idx] = cache_rows.index_select(0, c_idx)
            else:
                cache_rows[c_idx] = slot_rows.index_select(0, s_idx)
