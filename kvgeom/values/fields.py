"""Field validators and converters shared by the value classes: integers are ints (never bool, never float).

Every check raises a typed :class:`~kvgeom.errors.KvGeomError` naming the field's path, never ``assert``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arith.ints import MAX_INT
from ..errors import GeometryError, KvGeomError

__all__ = ["is_int", "check_int", "attr_int", "pos_int", "nonneg_int", "as_tuple", "int_tuple", "MAX_INT"]


def is_int(value: Any) -> bool:
    """True for ``int`` and numpy integers; ``bool`` and ``float`` are not sizes."""
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return False
    return isinstance(value, (int, np.integer))


def check_int(
    path: str, value: Any, *, minimum: int = 0, error: type[KvGeomError] = GeometryError
) -> int:
    """``value`` as a Python int; raise ``error`` unless it is an integer in ``[minimum, MAX_INT]``.

    The one integer rule: value classes, pair files, handshakes and the strategies' arguments all
    check through it (each with its own error type).
    """
    if not is_int(value):
        raise error(
            path,
            f"must be an integer, got {type(value).__name__} {value!r}",
            actual=value,
            expected=f"int >= {minimum}",
            fix=f"pass a plain int (e.g. {minimum if minimum > 0 else 0})",
        )
    if value < minimum:
        raise error(
            path,
            f"must be >= {minimum}, got {value}",
            actual=value,
            expected=f">= {minimum}",
            fix=f"use a value of at least {minimum}",
        )
    if value > MAX_INT:
        raise error(
            path,
            f"{value} is beyond the largest size kvgeom accepts (2**48 = {MAX_INT})",
            actual=value,
            expected=f"<= {MAX_INT}",
            fix="describe real byte and token counts (a remote that advertises such sizes is refused)",
        )
    return int(value)


def attr_int(minimum: int) -> Any:
    """attrs validator: the field is an int >= ``minimum``; the path is ``Class.field``."""

    def _validator(instance: Any, attribute: Any, value: Any) -> None:
        check_int(f"{type(instance).__name__}.{attribute.name}", value, minimum=minimum)

    return _validator


pos_int = attr_int(1)
nonneg_int = attr_int(0)


def as_tuple(value: Any, path: str, error: type[KvGeomError] = GeometryError) -> tuple[Any, ...]:
    """``tuple(value)``, or ``error`` naming ``path`` when ``value`` is not a sequence."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise error(path, f"must be a sequence, got {type(value).__name__} {value!r}", actual=value,
                    expected="a list or tuple", fix="pass a list or tuple")
    return tuple(value)


def int_tuple(value: Any) -> tuple[int, ...]:
    """attrs converter: any iterable of ints to a tuple of python ints (hashable, frozen)."""
    out = []
    if hasattr(value, "tolist"):
        value = value.tolist()
    for v in as_tuple(value, "ids"):
        if is_int(v):
            out.append(int(v))
        else:
            out.append(v)  # left for the validator to reject with a path
    return tuple(out)
