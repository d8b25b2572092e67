"""The exception family of kvgeom: every rejection is a ``ValueError`` that names its field.

Bad input raises a :class:`KvGeomError` (a ``ValueError``); a broken invariant that kvgeom maintains
itself raises :class:`InternalError`, which is deliberately *not* a ``ValueError``, so a connector's
``except ValueError`` for bad input never swallows a planner bug::

    Exception
      ValueError
        KvGeomError           GeometryError, RequestError, IncompatibleGeometry, SchemaError, PlanError
      InternalError           a kvgeom bug (never bad input)

Each error carries ``path`` (where the bad value sits, e.g. ``decode.groups[1].window_tokens``),
``actual`` (the value given), ``expected`` (what would have been accepted) and ``fix`` (what to
change). ``str(err)`` puts all four in one line so a log line alone says what to do::

    GeometryError: decode.tp: 3 does not divide num_kv_heads=8 and is not a multiple of it
    (expected: a divisor or multiple of 8; fix: use tp in {1, 2, 4, 8, 16, ...})
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KvGeomError",
    "GeometryError",
    "RequestError",
    "IncompatibleGeometry",
    "SchemaError",
    "PlanError",
    "StagingCapacityError",
    "InternalError",
]


def _text(path: str, message: str, expected: Any, fix: str) -> str:
    """``"path: message (expected: ...; fix: ...)"``, the one line every kvgeom error prints."""
    text = f"{path}: {message}"
    extras = []
    if expected is not None:
        extras.append(f"expected: {expected}")
    if fix:
        extras.append(f"fix: {fix}")
    if extras:
        text += " (" + "; ".join(extras) + ")"
    return text


class KvGeomError(ValueError):
    """Root of every error kvgeom raises on bad input. A ``ValueError``, never an ``assert``."""

    def __init__(
        self,
        path: str,
        message: str,
        *,
        actual: Any = None,
        expected: Any = None,
        fix: str = "",
    ) -> None:
        self.path = path
        self.message = message
        self.actual = actual
        self.expected = expected
        self.fix = fix
        super().__init__(_text(path, message, expected, fix))

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields through pickling (multiprocessing)
        return (_rebuild, (type(self), self.path, self.message, self.actual, self.expected, self.fix))


def _rebuild(
    cls: type[KvGeomError], path: str, message: str, actual: Any, expected: Any, fix: str
) -> KvGeomError:
    return cls(path, message, actual=actual, expected=expected, fix=fix)


class GeometryError(KvGeomError):
    """One engine's description is invalid on its own (sizes, layouts, regions, TP)."""


class RequestError(KvGeomError):
    """A request does not fit the pair it is planned for (block ids, token positions, lengths)."""


class IncompatibleGeometry(KvGeomError):
    """Two valid engines cannot exchange KV cache (different model facts, group sets...)."""


class SchemaError(GeometryError):
    """A serialized document (pair file, handshake) is malformed, truncated, of another version or inconsistent."""


class PlanError(KvGeomError):
    """A plan container was built with malformed columns (lengths, dtypes, negative sizes)."""


class StagingCapacityError(KvGeomError):
    """A packed plan's staging capacity cannot hold the request's smallest piece (one token of one
    attention layer, or one state section of one layer) on some rank."""


class InternalError(Exception):
    """An invariant kvgeom maintains itself was broken: a bug in kvgeom, never bad input.

    Not a ``ValueError`` (nor a :class:`KvGeomError`): code that catches bad input must not catch
    planner bugs. It carries the same ``path``, ``message``, ``actual``, ``expected`` and ``fix``
    fields as :class:`KvGeomError`, so a log line reads the same.
    """

    def __init__(self, what: str, *, path: str = "kvgeom", actual: Any = None, expected: Any = None) -> None:
        self.what = what
        self.path = path
        self.message = f"internal invariant broken: {what}"
        self.actual = actual
        self.expected = expected
        self.fix = "report this as a kvgeom bug"
        super().__init__(_text(path, self.message, expected, self.fix))

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields through pickling (multiprocessing)
        return (_rebuild_internal, (self.what, self.path, self.actual, self.expected))


def _rebuild_internal(what: str, path: str, actual: Any, expected: Any) -> InternalError:
    return InternalError(what, path=path, actual=actual, expected=expected)
