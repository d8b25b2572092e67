"""Tools built on every layer below: the command line, pair files and handshake documents (serialize),
and, with the ``testing`` extra, hypothesis strategies (``kvgeom.tools.strategies``) and the fuzzer.

This face imports only :mod:`kvgeom.tools.serialize`, so importing it never pulls in hypothesis:
import the strategies module by name (``from kvgeom.tools import strategies as kst``).
"""

from __future__ import annotations

from .serialize import (
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    MAX_NUMBER_DIGITS,
    SCHEMA_VERSION,
    dump_pair_file,
    dumps,
    from_dict,
    load_pair_file,
    loads,
    pair_file_dict,
    parse_json,
    parse_pair_file,
    read_bounded,
    to_dict,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "MAX_NUMBER_DIGITS",
    "SCHEMA_VERSION",
    "dump_pair_file",
    "dumps",
    "from_dict",
    "load_pair_file",
    "loads",
    "pair_file_dict",
    "parse_json",
    "parse_pair_file",
    "read_bounded",
    "to_dict",
]
