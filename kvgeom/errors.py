"""The exception family of kvgeom: every rejection is a ``ValueError`` that names its field.

Bad input raises a :class:`KvGeomError` (a ``ValueError``); a broken invariant that kvgeom maintains
itself raises :class:`InternalError`, which is deliberately *not* a ``ValueError``, so a connector's
``except ValueError`` for bad input never swallows a planner bug::

    Exception
      ValueError
        KvGeomError           GeometryError, RequestError, IncompatibleGeometry, SchemaError, PlanError,
                              StagingCapacityError, PlanBudgetExceeded
          MissingExtra        an optional dependency is not installed (also an ImportError)
      InternalError           a kvgeom bug (never bad input)

Each error carries ``path`` (where the bad value sits, e.g. ``decode.groups[1].window_tokens``),
``actual`` (the value given), ``expected`` (what would have been accepted) and ``fix`` (what to
change). ``str(err)`` puts all four in one line so a log line alone says what to do::

    GeometryError: decode.tp: 3 does not divide num_kv_heads=8 and is not a multiple of it
    (expected: a divisor or multiple of 8; fix: use tp in {1, 2, 4, 8, 16, ...})

An error with several reasons (two engines that differ in more than one model fact) keeps each
reason whole after the first, its own expected and fix included: ``"<first> [+1 more: <second>]"``.
Values are written with :func:`value_text`, which never formats an integer of more than 64 digits
(Python refuses ``str()`` of an int beyond 4300 digits, and a hostile value may be that long).

:class:`PlanBudgetExceeded` refuses a request whose plan would be too large to build
(docs/design.md §14): it names the estimate, the budget and how to raise the budget.

Worked number: ``value_text(10**5000) == '<an integer of 16610 bits>'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "value_text",
    "KvGeomError",
    "GeometryError",
    "RequestError",
    "IncompatibleGeometry",
    "SchemaError",
    "PlanError",
    "StagingCapacityError",
    "InternalError",
    "PlanBudgetExceeded",
    "MissingExtra",
    "install_hint",
]

MAX_VALUE_BITS = 212  # 64 decimal digits: a longer integer is written by its size


def value_text(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; never formats a huge int (nor fails on one inside a list).

    >>> value_text(2**48), value_text(10**5000), value_text("draft"), value_text("x" * 300, limit=8)
    ('281474976710656', '<an integer of 16610 bits>', "'draft'", "'xxxx...")
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_VALUE_BITS:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value[: limit + 1]) if isinstance(value, str) else repr(value)
    except Exception:  # noqa: BLE001 - e.g. a list holding a huge int: described by its type
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def _part(value: Any) -> str:
    if isinstance(value, str):  # expected/fix phrases are written as they are
        return value if len(value) <= 400 else value[:397] + "..."
    return value_text(value, limit=400)


def _text(path: str, message: str, expected: Any, fix: str) -> str:
    """``"path: message (expected: ...; fix: ...)"``, the one line every kvgeom error prints."""
    text = f"{path}: {message}"
    extras = []
    if expected is not None:
        extras.append(f"expected: {_part(expected)}")
    if fix:
        extras.append(f"fix: {fix}")
    if extras:
        text += " (" + "; ".join(extras) + ")"
    return text


class KvGeomError(ValueError):
    """Root of every error kvgeom raises on bad input. A ``ValueError``, never an ``assert``.

    ``more`` lists further reasons for the same refusal; each keeps its own expected and fix.
    """

    def __init__(
        self,
        path: str,
        message: str,
        *,
        actual: Any = None,
        expected: Any = None,
        fix: str = "",
        more: Sequence[KvGeomError] = (),
    ) -> None:
        self.path = path
        self.message = message
        self.actual = actual
        self.expected = expected
        self.fix = fix
        self.more: tuple[KvGeomError, ...] = tuple(more)
        text = _text(path, message, expected, fix)
        if self.more:
            text += f" [+{len(self.more)} more: " + "; ".join(str(m) for m in self.more) + "]"
        super().__init__(text)

    @property
    def reasons(self) -> tuple[KvGeomError, ...]:
        """This error and every further reason, in order."""
        return (self, *self.more)

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields through pickling (multiprocessing)
        return (_rebuild, (type(self), self.path, self.message, self.actual, self.expected, self.fix, self.more))


def _rebuild(
    cls: type[KvGeomError], path: str, message: str, actual: Any, expected: Any, fix: str,
    more: tuple[KvGeomError, ...] = (),
) -> KvGeomError:
    return cls(path, message, actual=actual, expected=expected, fix=fix, more=more)


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


class PlanBudgetExceeded(KvGeomError):
    """A request whose plan (rows, bytes or planning steps) would exceed the planner's budget.

    Raised before any row is built, from an estimate in O(groups x ranks) arithmetic
    (docs/design.md §14). ``actual`` is the estimate and ``expected`` the budget.
    """


class StagingCapacityError(KvGeomError):
    """A packed plan's staging capacity cannot hold the request's smallest piece (one token of one
    attention layer, or one state section of one layer) on some rank."""


class MissingExtra(KvGeomError, ImportError):  # type: ignore[misc]  # ``path`` is KvGeomError's field path
    """An optional dependency is not installed: ``path`` names the module, ``fix`` the pip command
    (:func:`install_hint`). Both a :class:`KvGeomError` and an ``ImportError``, so ``except
    ImportError`` around an optional import still catches it."""

    def __init__(self, path: str, message: str, **kwargs: Any) -> None:
        super().__init__(path, message, **kwargs)
        self.name = path  # ImportError's field: the module that is missing
        self.msg = str(self)


def install_hint(extra: str, root: Path | None = None) -> str:
    """The pip command that installs kvgeom's ``extra`` the way this kvgeom was installed.

    From a source checkout (``root``, by default the folder above this package, holds
    ``pyproject.toml``): ``pip install -e "<root>[extra]"``; from a wheel: ``pip install "kvgeom[extra]"``.

    >>> install_hint("notebook", root=Path("/nonexistent"))
    'pip install "kvgeom[notebook]"'
    """
    root = Path(__file__).resolve().parent.parent if root is None else root
    if (root / "pyproject.toml").is_file() and (root / "kvgeom" / "__init__.py").is_file():
        return f'pip install -e "{root}[{extra}]"'
    return f'pip install "kvgeom[{extra}]"'


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
