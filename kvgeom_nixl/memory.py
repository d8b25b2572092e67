"""A rank's regions as registrable memory: torch tensors, numpy arrays or raw (pointer, bytes).

Each region of the rank's geometry is one range of caller memory, registered whole, never copied::

    geometry.regions[i] = Region(num_pages, page_bytes)
    buffers[i]          = torch.Tensor (CPU -> DRAM, CUDA -> VRAM) | numpy array | (ptr, nbytes)
                          exactly num_pages * page_bytes bytes, dense (contiguous in some axis
                          order: a permuted view such as FlashAttention's K plane is one region)

or, instead of the buffers, the very :class:`kvgeom.LayerTensors` the geometry was read from
(``EngineGeometry.from_tensors``): :func:`region_buffers` finds each region's bytes in them, in
region order, as flat ``uint8`` views of the same allocations (one allocation may hold several
regions: FlashAttention's ``(2, blocks, ...)`` tensor is a K and a V region).

The caller's objects are kept (not replaced, permuted or made contiguous) and referenced for as
long as the memory is registered; receive steps work on flat ``uint8`` *views* of them
(docs/design.md §8: attention backends need the very tensors they allocated).

Worked number: a region of 64 pages x 16384 B needs a 1 MiB buffer, e.g.
``torch.empty(64, 2, 2, 16, 128, dtype=torch.bfloat16)`` (64 * 2 * 2 * 16 * 128 * 2 B = 1048576 B).
With pipeline stages a rank holds only its stage's regions (``engine.rank_regions(rank)``,
docs/design.md §11.4): it passes one buffer for each of those, in that order, and the arrays
indexed by region (``bases``, ``devices``, ``sizes``, ``byte_views``) are 0 / None for the others.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvgeom import EngineGeometry, LayerTensors, value_text
from kvgeom.lowering import rank_region_bytes
from kvgeom.values import region_spans, tensor_facts

from .errors import RegistrationError

__all__ = ["RegionMemory", "RankMemory", "MEM_TYPES", "region_buffers"]

MEM_TYPES = ("DRAM", "VRAM")


@attrs.frozen(eq=False)
class RegionMemory:
    """One registered allocation: address, size, NIXL memory type and device id, and its owner."""

    addr: int
    nbytes: int
    mem_type: str
    device: int
    owner: Any = attrs.field(repr=False)  # the caller's tensor / array (kept alive), or None


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch is already imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _dense(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether the elements cover one gap-free byte range (contiguous in some order of the axes)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    expect = itemsize
    for st, n in dims:
        if st != expect:
            return False
        expect *= n
    return True


def _flat_view(buf: Any) -> Any:
    """A flat uint8 tensor over the bytes of a dense torch tensor, in the same storage (never a copy)."""
    import torch

    st = buf.untyped_storage()
    nbytes = buf.numel() * buf.element_size()
    return torch.empty(0, dtype=torch.uint8, device=buf.device).set_(st, buf.data_ptr() - st.data_ptr(),
                                                                      (nbytes,), (1,))


def _region(path: str, buf: Any, want: int, mem_type: str | None, device: int | None) -> RegionMemory:
    if _is_tensor(buf):
        if not buf.is_contiguous():
            if not _dense(tuple(buf.shape), tuple(buf.stride()), 1) or buf.numel() == 0:
                raise RegistrationError(path, f"tensor of shape {tuple(buf.shape)} and strides "
                                        f"{tuple(buf.stride())} has gaps between its elements",
                                        actual=tuple(buf.stride()), expected="a dense tensor (any axis order)",
                                        fix="pass the LayerTensors the geometry was read from (kvgeom_nixl."
                                            "region_buffers finds each region in them), or the region's own bytes")
            buf = _flat_view(buf)  # a permuted view of one region (FlashAttention's K plane): its bytes, as is
        nbytes = buf.numel() * buf.element_size()
        kind = buf.device.type
        if kind == "cpu":
            mt, dev = "DRAM", 0
        elif kind == "cuda":
            mt, dev = "VRAM", int(buf.device.index or 0)
        else:
            raise RegistrationError(path, f"tensors on {kind!r} cannot be registered", actual=kind,
                                    expected="cpu or cuda")
        if mem_type is not None and mem_type != mt:
            raise RegistrationError(path, f"a {kind} tensor is {mt}, not {mem_type}", actual=mem_type, expected=mt,
                                    fix="drop mem_type for tensors; it follows the tensor's device")
        addr = int(buf.data_ptr())
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise RegistrationError(path, "numpy array is not C-contiguous", actual=buf.strides,
                                    expected="a C-contiguous array", fix="register the allocation itself")
        nbytes, addr, mt, dev = int(buf.nbytes), int(buf.ctypes.data), "DRAM", 0
        if mem_type not in (None, "DRAM"):
            raise RegistrationError(path, f"a numpy array is host memory, not {mem_type}", actual=mem_type,
                                    expected="DRAM")
    elif isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, (int, np.integer)) for x in buf):
        addr, nbytes = int(buf[0]), int(buf[1])
        mt = mem_type or "DRAM"
        dev = 0 if device is None else int(device)
        if addr <= 0:
            raise RegistrationError(path, f"pointer {addr} is not a valid address", actual=addr, expected="> 0")
        buf = None
    else:
        raise RegistrationError(path, f"cannot register a {type(buf).__name__}", actual=type(buf).__name__,
                                expected="torch.Tensor, numpy.ndarray or (pointer, nbytes)")
    if mt not in MEM_TYPES:
        raise RegistrationError(path, f"unknown memory type {value_text(mt, 60)}", actual=mt, expected=list(MEM_TYPES))
    if nbytes != want:
        raise RegistrationError(path, f"{nbytes} B for a region of {want} B", actual=nbytes, expected=want,
                                fix="pass exactly the region's num_pages * page_bytes bytes")
    return RegionMemory(addr, nbytes, mt, dev, buf)


def _tensors_of(entry: LayerTensors) -> list[Any]:
    t = entry.tensors
    if isinstance(t, Mapping):
        return list(t.values())
    if isinstance(t, (tuple, list)):
        return list(t)
    return [t]


def _numpy_root(arr: np.ndarray) -> np.ndarray | None:
    root: Any = arr
    while isinstance(getattr(root, "base", None), np.ndarray):
        root = root.base
    return root if isinstance(root, np.ndarray) and root.flags.c_contiguous else None


def _span_buffer(path: str, start: int, nbytes: int, owners: list[Any]) -> Any:
    """The bytes ``[start, start + nbytes)`` as a flat uint8 view of the tensor or array that holds them."""
    for t in owners:
        if _is_tensor(t):
            st = t.untyped_storage()
            if st.data_ptr() <= start and start + nbytes <= st.data_ptr() + st.nbytes():
                import torch

                return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, start - st.data_ptr(),
                                                                                (nbytes,), (1,))
        elif isinstance(t, np.ndarray):
            root = _numpy_root(t)
            if root is not None:
                base = int(root.ctypes.data)
                if base <= start and start + nbytes <= base + root.nbytes:
                    return root.reshape(-1).view(np.uint8)[start - base:start - base + nbytes]
    raise RegistrationError(path, f"no tensor given holds the region's bytes [{start:#x}, {start + nbytes:#x})",
                            actual=(start, nbytes), expected="torch tensors or numpy arrays that own the cache",
                            fix="pass the region buffers themselves (region order)")


def region_buffers(engine: EngineGeometry, layers: Sequence[LayerTensors], *, sizes: Mapping[str, int] | None = None,
                   state_layout: Any = None) -> tuple[Any, ...]:
    """The buffers of ``engine``'s regions, in region order, found in the ``layers`` it was read from.

    ``layers`` (and ``sizes`` / ``state_layout``) are what was given to
    :meth:`kvgeom.EngineGeometry.from_tensors`; each buffer is a flat ``uint8`` view of the tensor
    (or array) that holds the region, on its device, sharing its memory (nothing is copied). Raises
    :class:`RegistrationError` when the tensors describe another geometry than ``engine``.

    Worked number: FlashAttention HND, 2 layers of ``(2, 64, 16, 8, 128)`` bf16 tensors: 4 regions
    of 64 x 32768 B, ``[layer 0 K, layer 0 V, layer 1 K, layer 1 V]``, each 2 MiB of its layer's tensor.
    """
    entries = list(layers)
    for i, e in enumerate(entries):
        if not isinstance(e, LayerTensors):
            raise RegistrationError(f"regions[{i}]", f"expected LayerTensors, got {type(e).__name__}",
                                    actual=type(e).__name__, fix="pass every layer's LayerTensors, or buffers only")
    if not engine.topology.trivial:
        raise RegistrationError("regions", "LayerTensors describe an engine without pipeline stages, DCP or replicas",
                                actual=engine.topology.describe(engine.tp), expected="a plain TP engine",
                                fix="pass the region buffers of the rank's stage (engine.rank_regions(rank) order)")
    kw: dict[str, Any] = dict(tp=engine.tp, layers=entries, kernel_block_tokens=engine.kernel_block_tokens,
                              blocks_per_logical=engine.blocks_per_logical, sizes=sizes, state_layout=state_layout,
                              name=engine.name)
    read = EngineGeometry.from_tensors(engine.model, **kw)
    if read != engine:
        raise RegistrationError("regions", "these tensors describe another geometry than the endpoint's",
                                actual=read.summary(), expected=engine.summary(),
                                fix="pass the LayerTensors the geometry was read from (EngineGeometry.from_tensors)")
    owners = [t for e in entries for t in _tensors_of(e)]
    for i, t in enumerate(owners):
        tensor_facts(t, f"regions.tensors[{i}]")  # a typed error for anything that is not a tensor or array
    return tuple(_span_buffer(f"regions[{i}]", start, nbytes, owners)
                 for i, (start, nbytes) in enumerate(region_spans(engine.model, **kw)))


class RankMemory:
    """The regions one rank holds (all of them, or its pipeline stage's), checked against its
    geometry, in region order. ``buffers`` may also be the :class:`kvgeom.LayerTensors` the
    geometry was read from (:func:`region_buffers`)."""

    def __init__(self, engine: EngineGeometry, buffers: Sequence[Any], *, mem_type: str | None = None,
                 device: int | None = None, rank: int = 0) -> None:
        bufs = list(buffers)
        if bufs and all(isinstance(b, LayerTensors) for b in bufs):
            bufs = list(region_buffers(engine, bufs))
        self.region_ids: tuple[int, ...] = engine.rank_regions(rank)
        if len(bufs) != len(self.region_ids):
            what = f"an engine with {len(self.region_ids)} regions" if engine.topology.pp == 1 else \
                f"the {len(self.region_ids)} regions rank {rank}'s pipeline stage holds ({list(self.region_ids)})"
            raise RegistrationError("regions", f"{len(bufs)} buffers for {what}",
                                    actual=len(bufs), expected=len(self.region_ids),
                                    fix="pass one buffer per region the rank holds, in the geometry's region order")
        self.engine = engine
        self.sizes: tuple[int, ...] = rank_region_bytes(engine, rank)
        self.regions: tuple[RegionMemory, ...] = tuple(
            _region(f"regions[{i}]", b, engine.regions[r].nbytes, mem_type, device) for i, (b, r) in
            enumerate(zip(bufs, self.region_ids, strict=True)))
        kinds = {r.mem_type for r in self.regions}
        if len(kinds) > 1:
            raise RegistrationError("regions", f"regions mix memory types {sorted(kinds)}", actual=sorted(kinds),
                                    expected="one memory type per rank", fix="keep a rank's cache on one device")
        self.mem_type = self.regions[0].mem_type
        self._views: list[Any] | None = None

    @property
    def owners(self) -> tuple[Any, ...]:
        return tuple(r.owner for r in self.regions)

    def descs(self) -> np.ndarray:
        """``(addr, nbytes, device)`` per region as the Nx3 uint64 array NIXL registers."""
        out = np.empty((len(self.regions), 3), np.uint64)
        out[:, 0] = [r.addr for r in self.regions]
        out[:, 1] = [r.nbytes for r in self.regions]
        out[:, 2] = [r.device for r in self.regions]
        return out

    def _by_region(self, values: list[int]) -> np.ndarray:
        out = np.zeros(len(self.engine.regions), np.uint64)
        out[list(self.region_ids)] = values
        return out

    @property
    def bases(self) -> np.ndarray:
        """Base address per region of the geometry (0 for regions of other stages)."""
        return self._by_region([r.addr for r in self.regions])

    @property
    def devices(self) -> np.ndarray:
        return self._by_region([r.device for r in self.regions])

    def byte_views(self) -> list[Any]:
        """Flat ``torch.uint8`` views per region of the geometry (``None`` for raw VRAM pointers and
        for regions of other stages)."""
        if self._views is None:
            views: list[Any] = [None] * len(self.engine.regions)
            for rid, r in zip(self.region_ids, self.regions, strict=True):
                views[rid] = _byte_view(r)
            self._views = views
        return self._views

    def device(self) -> Any:
        import torch

        r = self.regions[0]
        return torch.device("cuda", r.device) if r.mem_type == "VRAM" else torch.device("cpu")

    def release(self) -> None:
        self._views = None
        self.regions = ()


def _byte_view(r: RegionMemory) -> Any:
    import torch

    obj = r.owner
    if _is_tensor(obj):
        return obj.detach().reshape(-1).view(torch.uint8)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.reshape(-1).view(np.uint8))
    if r.mem_type == "DRAM":
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr))
        return torch.from_numpy(arr)
    return None
