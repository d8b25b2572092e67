"""The command line's output files: a drawing's path, opened and proven writable before any work."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Any

from ..errors import KvGeomError

__all__ = ["OutputFile", "IMAGE_SUFFIXES", "check_drawing_path"]


class OutputFile:
    """An output path opened (and proven writable) before any work: ``--svg``/``--png``.

    ``os.access`` is not enough (root passes it for any path, and it says nothing of a full
    device or of ``/proc``), so the file is opened for writing and one byte is written and flushed
    (``/dev/full`` and ``/proc/version`` fail there), then a regular file is emptied again. A pipe
    or socket is refused without opening it (an open for writing would wait for a reader). A file
    this command created is removed again if the command fails before writing it.
    """

    def __init__(self, flag: str, path: str) -> None:
        self.flag = flag
        self.path = path
        existed = os.path.lexists(path)
        try:
            if existed and stat.S_ISFIFO(os.stat(path).st_mode) or existed and stat.S_ISSOCK(os.stat(path).st_mode):
                raise OSError(0, "a pipe or socket, not a file")
            self.file: Any = open(path, "wb")  # noqa: SIM115 - kept open until the drawing is written
            self.file.write(b"\n")
            self.file.flush()
            if stat.S_ISREG(os.fstat(self.file.fileno()).st_mode):
                self.file.seek(0)
                self.file.truncate(0)
        except OSError as e:
            with contextlib.suppress(Exception):
                self.file.close()
            raise KvGeomError(flag, f"cannot write {path!r}: {e.strerror or e}", actual=path,
                              expected="a writable file path", fix="pass a file path in an existing, writable folder") \
                from None
        self.created = not existed
        self.written = False

    def done(self) -> None:
        self.written = True
        self.file.close()

    def abandon(self) -> None:
        """The command failed before writing: close, and remove the file if this command made it."""
        with contextlib.suppress(Exception):
            self.file.close()
        if self.created and not self.written:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


IMAGE_SUFFIXES = (".svg", ".png", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp", ".gif")


def check_drawing_path(flag: str, path: str) -> None:
    """``--svg x.png`` would write SVG into a file named for another format: refused, naming the flag to use."""
    fmt = flag.lstrip("-")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in IMAGE_SUFFIXES and suffix != f".{fmt}":
        other = {".svg": "--svg", ".png": "--png"}.get(suffix)
        fix = f"use {other} {path}" if other else f"name the file *.{fmt}, or use --svg/--png for those formats"
        raise KvGeomError(flag, f"{path!r} names a {suffix[1:].upper()} file, but {flag} writes {fmt.upper()}",
                          actual=suffix, expected=f".{fmt} (or no image suffix)", fix=fix)
