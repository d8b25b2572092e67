"""One engine's memory as the simulator sees it: a flat uint8 array per rank and region.

The simulator never models devices, tensors or strides of its own: a region is its whole
allocation, ``num_pages * page_bytes`` bytes, and every address the geometry computes
(docs/design.md §3.2) is a byte offset into it::

    Memory(engine).buffers[rank][region]    rank 0: [ region 0 | region 1 | ... ]
                                            rank 1: [ region 0 | region 1 | ... ]
                                            ...     (each a flat uint8 array)

``allocate`` makes fresh zeroed arrays; ``wrap`` adopts existing ones (the executor's tests pass
their torch caches viewed as bytes, so the simulator checks the very memory NIXL wrote).

Worked number: P engine TP1, HND, 2 local heads of 256 B, K = 16, K/V packed: one page is
2 planes x 2 heads x 16 tokens x 256 B = 16384 B, so a region of 64 pages is one array of
64 x 16384 = 1048576 B.

With pipeline stages (docs/design.md §11.4) a rank holds only its stage's regions: the others are
zero-length arrays in ``buffers[rank]``, so any row that names them is out of bounds. Work over memory runs in steps of ``CHUNK = 1 << 22`` elements, which
bounds an int64 index array to 32 MiB.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..errors import GeometryError, PlanBudgetExceeded
from ..values.engine import EngineGeometry

__all__ = ["Memory", "MAX_ALLOCATED_BYTES"]

CHUNK = 1 << 22  # package-internal: elements per vectorized step (bounds the int64 index arrays to 32 MiB)
MAX_ALLOCATED_BYTES = 4 << 30  # one engine's memory the simulator allocates by default (it fills every byte)


@attrs.define(eq=False)
class Memory:
    """Every rank's regions of one engine as flat uint8 arrays: ``buffers[rank][region]``."""

    engine: EngineGeometry
    buffers: list[list[np.ndarray]]

    @staticmethod
    def check_size(engine: EngineGeometry, *, max_bytes: int = MAX_ALLOCATED_BYTES) -> None:
        """Refuse (:class:`~kvgeom.errors.PlanBudgetExceeded`) an engine of more than ``max_bytes``
        bytes over all ranks, in O(regions): :func:`~kvgeom.checking.simulate` asks first, before its
        per-rank checks, so a hostile rank count is refused before any loop over the ranks."""
        total = engine.total_bytes
        if total > max_bytes:
            raise PlanBudgetExceeded(f"Memory.allocate({engine.name})", f"the simulator would allocate {total:,} B "
                                     f"for this engine, beyond {max_bytes:,} B", actual=total,
                                     expected=f"<= {max_bytes}",
                                     fix="simulate smaller engines (fewer blocks or layers), or pass max_bytes=")

    @classmethod
    def allocate(cls, engine: EngineGeometry, *, max_bytes: int = MAX_ALLOCATED_BYTES) -> Memory:
        """Zero-filled buffers of ``num_pages * page_bytes`` for every rank and every region its stage
        holds (zero-length arrays for the regions of other stages).

        Refuses (:class:`~kvgeom.errors.PlanBudgetExceeded`, before any allocation) an engine of more
        than ``max_bytes`` bytes over all ranks: the simulator touches every byte it allocates, so an
        engine describing terabytes would otherwise be allocated lazily and then fill the machine.
        """
        cls.check_size(engine, max_bytes=max_bytes)
        out = []
        for rank in range(engine.num_ranks):
            held = set(engine.rank_regions(rank))
            out.append([np.zeros(r.nbytes if i in held else 0, np.uint8) for i, r in enumerate(engine.regions)])
        return cls(engine, out)

    @classmethod
    def wrap(cls, engine: EngineGeometry, buffers: Any) -> Memory:
        """Use existing uint8 arrays (e.g. ``tensor.view(torch.uint8).numpy()``) without copying.

        Each ``buffers[rank][region]`` must be a C-contiguous, writable uint8 array of exactly the
        region's ``num_pages * page_bytes`` bytes; it is kept as a flat view of the same memory.
        """
        ranks = list(buffers)
        if len(ranks) != engine.num_ranks:
            raise GeometryError("Memory.buffers", f"{len(ranks)} ranks of buffers for an engine of "
                                f"{engine.num_ranks} ranks (tp={engine.tp})", actual=len(ranks),
                                expected=engine.num_ranks, fix="pass one list of regions per rank")
        out: list[list[np.ndarray]] = []
        for rank, regs in enumerate(ranks):
            regs = list(regs)
            if len(regs) != len(engine.regions):
                raise GeometryError(f"Memory.buffers[{rank}]", f"{len(regs)} buffers for {len(engine.regions)} regions",
                                    actual=len(regs), expected=len(engine.regions),
                                    fix="pass one buffer per region, in the engine's region order")
            row: list[np.ndarray] = []
            held = set(engine.rank_regions(rank))
            for ri, (arr, region) in enumerate(zip(regs, engine.regions, strict=True)):
                path = f"Memory.buffers[{rank}][{ri}]"
                want = region.nbytes if ri in held else 0
                if not isinstance(arr, np.ndarray):
                    raise GeometryError(path, f"expected a numpy array, got {type(arr).__name__}",
                                        actual=type(arr).__name__, expected="numpy.ndarray of uint8",
                                        fix="pass tensor.view(torch.uint8).numpy() or a uint8 array")
                if arr.dtype != np.uint8:
                    raise GeometryError(path, f"dtype {arr.dtype} is not uint8", actual=str(arr.dtype),
                                        expected="uint8", fix="view the memory as bytes first")
                if arr.nbytes != want:
                    what = (f"a region of {region.num_pages} pages x {region.page_bytes} B = {region.nbytes} B"
                            if want else "a region of another pipeline stage (0 B on this rank)")
                    raise GeometryError(path, f"{arr.nbytes} B for {what}", actual=arr.nbytes, expected=want,
                                        fix="pass the region's whole allocation (an empty array for another "
                                            "stage's region)")
                if not arr.flags.c_contiguous or not arr.flags.writeable:
                    raise GeometryError(path, "the buffer must be C-contiguous and writable",
                                        actual={"c_contiguous": bool(arr.flags.c_contiguous),
                                                "writeable": bool(arr.flags.writeable)},
                                        expected="a contiguous writable array", fix="pass the allocation itself")
                row.append(arr.reshape(-1))
            out.append(row)
        return cls(engine, out)

    def copy(self) -> Memory:
        return Memory(self.engine, [[b.copy() for b in regs] for regs in self.buffers])

    @property
    def nbytes(self) -> int:
        return sum(b.size for regs in self.buffers for b in regs)


def check_memory(mem: Memory, engine: EngineGeometry, side: str) -> None:
    """Raise :class:`GeometryError` unless ``mem`` was made for ``engine`` (package-internal)."""
    if mem.engine.tp != engine.tp or mem.engine.regions != engine.regions or mem.engine.topology != engine.topology:
        raise GeometryError(f"Memory({side})", f"memory was made for {mem.engine.summary()}, "
                            f"not for the pair's {side} engine {engine.summary()}",
                            actual=mem.engine.name, expected=engine.name,
                            fix=f"allocate it with Memory.allocate(pair.{side})")
