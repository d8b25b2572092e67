"""One rank's staging buffer (a ring of slots) and the torch ops that pack into it and unpack from it
(docs/design.md §12.5). No geometry here: every view and index comes from :mod:`kvgeom.lowering`.

    StagingBuffer(slots x slot_bytes)   host: numpy memory (huge pages), CUDA: torch.empty on the device
      | slot 0 | slot 1 | ... |          a slot belongs to one (request id, chunk) at a time
      .acquire(owner) -> slot | None     .release(slot)   .quarantine(slot, until)   .tick()
    run_steps(steps, regions, buffer, slot, pack=True)    pack: cache -> slot;  pack=False: slot -> cache
      few page runs:   staging.as_strided(run).copy_(cache.as_strided(run))       (kvgeom.lowering.staged_runs)
      scattered pages: rows = staged_rows(step); slot_rows[s_idx] = cache_rows[c_idx]   (index gather/scatter)

A quarantined slot is one a peer or a NIXL request may still touch after its transfer failed: it
becomes free when what it waits for is settled (``until()`` returns True) or its grace time ends.

On host memory the copies run with one torch thread (:func:`host_copies`): on the project's 2-core
VM torch's intra-op threads turn an 80 KiB ``copy_`` into 8-12 ms of thread wake-ups, against 2 us
on one thread (a memory copy gains nothing from a second core that shares the memory bus).

Worked number: ``StagingBuffer(memory, slot_bytes=1 << 20, slots=2)`` registers 2 MiB; slot 1 starts
at byte 1,048,576, and a wire row at slot offset 4096 of slot 1 is NIXL address ``base + 1052672``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvgeom import StagingStep
from kvgeom.lowering import staged_rows, staged_runs

from .errors import ExecutorError
from .memory import RankMemory

__all__ = ["StagingBuffer", "run_steps", "DEFAULT_SLOTS", "host_copies"]

DEFAULT_SLOTS = 2  # pack chunk i + 1 while chunk i is on the wire


class StagingBuffer:
    """``slots`` slots of ``slot_bytes`` on the device of ``memory`` (the rank's cache)."""

    def __init__(self, memory: RankMemory, slot_bytes: int, slots: int = DEFAULT_SLOTS) -> None:
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ExecutorError("staging_bytes", f"a staging slot needs at least one byte, got {slot_bytes!r}",
                                actual=slot_bytes, expected=">= 1")
        if not isinstance(slots, int) or slots < 2:
            raise ExecutorError("staging_slots", f"a ring needs at least 2 slots to pipeline chunks, got {slots!r}",
                                actual=slots, expected=">= 2", fix="pass staging_slots=2 or more")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.nbytes = slot_bytes * slots
        device = memory.device()
        if device.type == "cpu":  # numpy asks the kernel for transparent huge pages on large arrays
            self.tensor = torch.from_numpy(np.empty(self.nbytes, np.uint8))
        else:
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.addr = int(self.tensor.data_ptr())
        self.device_id = 0 if device.type == "cpu" else int(device.index or 0)
        self.owner: list[tuple[str, int] | None] = [None] * slots
        self._quarantine: dict[int, tuple[float, Callable[[], bool]]] = {}

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
        self.tick()
        for s, o in enumerate(self.owner):
            if o is None and s not in self._quarantine:
                self.owner[s] = owner
                return s
        return None

    def release(self, slot: int) -> None:
        self.owner[slot] = None
        self._quarantine.pop(slot, None)

    def quarantine(self, slot: int, until: Callable[[], bool], grace_s: float) -> None:
        """Keep ``slot`` taken until ``until()`` is True or ``grace_s`` seconds have passed."""
        self._quarantine[slot] = (time.perf_counter() + grace_s, until)

    def tick(self) -> None:
        """Free the quarantined slots whose wait is over."""
        now = time.perf_counter()
        for s, (deadline, until) in list(self._quarantine.items()):
            done = now > deadline
            if not done:
                try:
                    done = bool(until())
                except Exception:  # noqa: BLE001 - a handle that cannot be queried any more is settled
                    done = True
            if done:
                del self._quarantine[s]
                self.owner[s] = None

    def free(self) -> int:
        """Slots neither owned nor quarantined."""
        return sum(o is None and s not in self._quarantine for s, o in enumerate(self.owner))

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
