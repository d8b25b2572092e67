"""One cache tensor read without torch: its shape, byte strides, item size, address and the
allocation it views (:class:`TensorFacts`, :func:`tensor_facts`), duck-typed on ``shape``,
``stride()`` / ``strides``, the item size and ``data_ptr()`` / ``__array_interface__``; every fact
checked as hostile input (addresses in ``[0, 2**64)``, dimensions and strides within ``MAX_INT``;
docs/design.md §10.1, §14). :mod:`kvgeom.values.tensors` builds an engine's geometry from them.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..arith.ints import MAX_INT, checked_product
from ..errors import GeometryError, value_text
from .fields import as_int, as_tuple, check_int, is_int, pos_int

ADDRESS_LIMIT = 1 << 64
"""Addresses (``data_ptr()``, a registered buffer's start) are 64-bit: ``0 <= address < 2**64``."""
MAX_DIMS = 64  # dimensions of one tensor (numpy allows 64)


def check_address(path: str, value: Any) -> int:
    """``value`` as a Python int if it is an address in ``[0, 2**64)``; else a ``GeometryError``."""
    if not is_int(value) or not 0 <= value < ADDRESS_LIMIT:
        raise GeometryError(path, f"an address is an integer in [0, 2**64), got {type(value).__name__} "
                            f"{value_text(value, 60)}", actual=value_text(value, 60), expected="0 <= address < 2**64",
                            fix="pass data_ptr() (torch) or __array_interface__['data'][0] (numpy)")
    return int(value)


def _ints(path: str, value: Any, minimum: int) -> tuple[int, ...]:
    """A shape or strides: at most ``MAX_DIMS`` ints, each in ``[minimum, MAX_INT]``."""
    items = as_tuple(value, path, max_len=MAX_DIMS)
    return tuple(check_int(f"{path}[{i}]", v, minimum=minimum) for i, v in enumerate(items))


def _shape(value: Any) -> tuple[int, ...]:
    return _ints("TensorFacts.shape", value, 0)


def _strides(value: Any) -> tuple[int, ...]:  # negative: a flipped view, refused by name when read
    return _ints("TensorFacts.strides", value, -MAX_INT)


def _allocation(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    items = as_tuple(value, "TensorFacts.allocation", max_len=2)
    if len(items) != 2:
        raise GeometryError("TensorFacts.allocation", f"{len(items)} entries", actual=value_text(value, 60),
                            expected="(start address, nbytes) or None", fix="pass (start address, nbytes)")
    return (check_address("TensorFacts.allocation[0]", items[0]),
            check_int("TensorFacts.allocation[1]", items[1], minimum=0))


def _address(instance: Any, attribute: Any, value: Any) -> None:
    check_address(f"{type(instance).__name__}.{attribute.name}", value)


@attrs.frozen(eq=False)
class TensorFacts:
    """What kvgeom reads from a tensor: shape, byte strides, item size, the address of element 0
    and the allocation it views (``(start address, nbytes)``, or ``None`` when unknown).

    Dimensions are in ``[0, MAX_INT]``, strides in ``[-MAX_INT, MAX_INT]`` bytes, at most 64 of
    each and as many strides as dimensions; addresses in ``[0, 2**64)``.
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    strides: tuple[int, ...] = attrs.field(converter=_strides)
    itemsize: int = attrs.field(converter=as_int, validator=pos_int)
    address: int = attrs.field(converter=as_int, validator=_address)
    allocation: tuple[int, int] | None = attrs.field(default=None, converter=_allocation)

    def __attrs_post_init__(self) -> None:
        if len(self.strides) != len(self.shape):
            raise GeometryError("TensorFacts.strides", f"{len(self.strides)} strides for {len(self.shape)} dimensions",
                                actual=len(self.strides), expected=len(self.shape), fix="one byte stride per dimension")

    @property
    def nbytes(self) -> int:
        return checked_product("TensorFacts.nbytes", *self.shape, self.itemsize, what="tensor's bytes")

    @property
    def contiguous(self) -> bool:
        expect = self.itemsize
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True


def _numpy_root(obj: Any) -> tuple[int, int] | None:
    """The allocation a numpy array views: follow ``.base`` to the object that owns the memory."""
    root = obj
    while getattr(root, "base", None) is not None:
        root = root.base
    if isinstance(root, np.ndarray):
        return int(root.__array_interface__["data"][0]), int(root.nbytes)
    try:
        view = np.frombuffer(root, np.uint8)
    except (TypeError, ValueError):
        return None
    return int(view.__array_interface__["data"][0]), int(view.nbytes)


def tensor_facts(t: Any, path: str = "tensor") -> TensorFacts:
    """:class:`TensorFacts` of a torch tensor, a numpy array, or a :class:`TensorFacts` (duck-typed)."""
    if isinstance(t, TensorFacts):
        return t
    shape = getattr(t, "shape", None)
    if shape is None:
        raise GeometryError(path, f"expected a tensor or array, got {type(t).__name__}", actual=type(t).__name__,
                            expected="a torch tensor, numpy array or TensorFacts",
                            fix="pass the cache tensor itself")
    shape_t = _ints(f"{path}.shape", shape, 0)
    stride = getattr(t, "stride", None)
    if callable(stride) and hasattr(t, "element_size") and hasattr(t, "data_ptr"):  # torch
        itemsize = check_int(f"{path}.element_size()", t.element_size(), minimum=1)
        strides = tuple(s * itemsize for s in _ints(f"{path}.stride()", stride(), -MAX_INT))
        address = check_address(f"{path}.data_ptr()", t.data_ptr())
        allocation: tuple[int, int] | None = None
        storage = getattr(t, "untyped_storage", None)
        if callable(storage):
            st = storage()
            allocation = (check_address(f"{path}.untyped_storage().data_ptr()", st.data_ptr()),
                          check_int(f"{path}.untyped_storage().nbytes()", st.nbytes()))
    elif hasattr(t, "strides") and hasattr(t, "__array_interface__"):  # numpy
        itemsize = check_int(f"{path}.itemsize", t.itemsize, minimum=1)
        strides = _ints(f"{path}.strides", t.strides, -MAX_INT)
        address = check_address(f"{path}.data", t.__array_interface__["data"][0])
        allocation = _numpy_root(t)
    else:
        raise GeometryError(path, f"cannot read strides and address of a {type(t).__name__}",
                            actual=type(t).__name__, expected="a torch tensor, numpy array or TensorFacts",
                            fix="pass TensorFacts(shape, byte strides, itemsize, address, allocation)")
    return TensorFacts(shape_t, strides, itemsize, address, allocation)

