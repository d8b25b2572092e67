"""Field validators and converters shared by the value classes: integers are Python ints (never bool,
never float, never a numpy integer kept as given), names are strings, nested values have their class.

Every check raises a typed :class:`~kvgeom.errors.KvGeomError` naming the field's path, never
``assert``, never an ``AttributeError`` or ``TypeError`` from deeper down::

    attrs field  --converter as_int-->  numpy integer -> int (anything else kept for the validator)
                 --validator attr_int-> check_int(path, value): int in [minimum, MAX_INT] or the error

Worked number: ``Region(np.int32(9000), np.int32(2**20))`` stores ``num_pages == 9000`` as a Python
int, so ``nbytes == 9000 * 2**20 == 9437184000`` (int32 arithmetic would have wrapped to 847249408).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..arith.ints import MAX_INT
from ..errors import GeometryError, KvGeomError, value_text

__all__ = ["is_int", "check_int", "as_int", "attr_int", "pos_int", "nonneg_int", "as_tuple", "int_tuple",
           "check_str", "check_instance", "check_seconds", "MAX_INT"]


def is_int(value: Any) -> bool:
    """True for ``int`` and numpy integers; ``bool`` and ``float`` are not sizes."""
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return False
    return isinstance(value, (int, np.integer))


def as_int(value: Any) -> Any:
    """attrs converter: a numpy integer becomes a Python int; anything else is kept for the validator.

    >>> type(as_int(np.uint64(7))), as_int("7")
    (<class 'int'>, '7')
    """
    return int(value) if is_int(value) else value


def check_int(
    path: str, value: Any, *, minimum: int = 0, error: type[KvGeomError] = GeometryError
) -> int:
    """``value`` as a Python int; raise ``error`` unless it is an integer in ``[minimum, MAX_INT]``.

    The one integer rule: value classes, pair files, handshakes and the strategies' arguments all
    check through it (each with its own error type). Messages never format a huge integer.
    """
    if not is_int(value):
        raise error(
            path,
            f"must be an integer, got {type(value).__name__} {value_text(value, 60)}",
            actual=value,
            expected=f"int >= {minimum}",
            fix=f"pass a plain int (e.g. {minimum if minimum > 0 else 0})",
        )
    if value < minimum:
        raise error(
            path,
            f"must be >= {minimum}, got {value_text(int(value))}",
            actual=value,
            expected=f">= {minimum}",
            fix=f"use a value of at least {minimum}",
        )
    if value > MAX_INT:
        raise error(
            path,
            f"{value_text(int(value))} is beyond the largest size kvgeom accepts (2**48 = {MAX_INT})",
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


def check_str(path: str, value: Any, *, error: type[KvGeomError] = GeometryError, empty: bool = True) -> str:
    """``value`` if it is a ``str`` (non-empty unless ``empty``); else ``error`` naming ``path``."""
    if not isinstance(value, str) or (not empty and not value):
        raise error(path, f"must be a {'non-empty ' if not empty else ''}string, got {type(value).__name__} "
                    f"{value_text(value, 60)}", actual=value, expected="str", fix="pass a plain string")
    return value


def check_instance(path: str, value: Any, cls: type | tuple[type, ...], *,
                   error: type[KvGeomError] = GeometryError, fix: str = "") -> Any:
    """``value`` if it is an instance of ``cls``; else ``error`` naming ``path`` (never an AttributeError later)."""
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise error(path, f"expected {names}, got {type(value).__name__} {value_text(value, 60)}",
                    actual=value_text(value, 60), expected=names, fix=fix or f"pass a {names}")
    return value


def check_seconds(path: str, value: Any, *, error: type[KvGeomError] = GeometryError) -> float:
    """A duration in seconds: a finite number > 0 (``nan``, ``inf``, 0 and negatives are refused).

    >>> check_seconds("timeout_s", 5)
    5.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(path, f"must be a number of seconds, got {type(value).__name__} {value_text(value, 60)}",
                    actual=value, expected="a finite number > 0", fix="pass e.g. 30.0")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise error(path, f"must be finite and > 0, got {value_text(value, 60)}", actual=value,
                    expected="a finite number > 0",
                    fix="pass a positive number of seconds (a deadline that never expires is not one)")
    return seconds


def as_tuple(value: Any, path: str, error: type[KvGeomError] = GeometryError, *,
             max_len: int | None = None) -> tuple[Any, ...]:
    """``tuple(value)``, or ``error`` naming ``path`` when ``value`` is not a sequence (or is longer
    than ``max_len``, checked before anything is copied when ``value`` knows its length)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or (
            isinstance(value, np.ndarray) and value.ndim != 1):
        raise error(path, f"must be a sequence, got {type(value).__name__} {value_text(value, 60)}",
                    actual=value_text(value, 60), expected="a list or tuple", fix="pass a list or tuple")
    if max_len is not None and hasattr(value, "__len__"):
        try:
            n = len(value)
        except (TypeError, OverflowError):
            n = max_len + 1
        if n > max_len:
            raise error(path, f"{value_text(n)} entries exceed the {max_len} kvgeom accepts", actual=n,
                        expected=f"<= {max_len} entries", fix="list fewer entries (is the request real?)")
    try:
        out = tuple(value)
    except TypeError as e:
        raise error(path, f"cannot be iterated: {e}", actual=value_text(value, 60), expected="a list or tuple",
                    fix="pass a list or tuple") from None
    if max_len is not None and len(out) > max_len:
        raise error(path, f"{len(out)} entries exceed the {max_len} kvgeom accepts", actual=len(out),
                    expected=f"<= {max_len} entries", fix="list fewer entries")
    return out


def int_tuple(value: Any) -> tuple[int, ...]:
    """attrs converter: any iterable of ints to a tuple of python ints (hashable, frozen)."""
    out = []
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return tuple(int(v) for v in value.tolist())
    for v in as_tuple(value, "ids"):
        if is_int(v):
            out.append(int(v))
        else:
            out.append(v)  # left for the validator to reject with a path
    return tuple(out)
