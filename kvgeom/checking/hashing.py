"""The bytes the simulator writes: a hash of each global coordinate, and two background patterns.

Every byte that a correct transfer must deliver is a function of the coordinate it belongs to
(docs/design.md §3.1), never of an address, so P and D can lay the same coordinate out anywhere and
still be compared byte for byte (docs/design.md §4.2, invariant 3)::

    key = seed                                   splitmix64's finalizer mix64 (a bijection of
    for field in coordinate:                     64-bit integers), GOLDEN = 0x9E3779B97F4A7C15
        key = mix64((key ^ field) + GOLDEN)
    byte b of the vector = byte b % 8 (little-endian) of mix64(key + (b // 8 + 1) * GOLDEN)

* attention: the seed 0x6174746E ("attn") absorbs (group, layer, plane, global head, token);
* state: the seed 0x73746174 ("stat") absorbs (group, layer, section, state tokens, global
  channel, row). The token count a state has absorbed is part of the key, so a D slot paired with a
  P slot of the wrong position receives visibly wrong bytes;
* background: P's garbage (outside computed coordinates) and D's stale bytes (before the transfer)
  are one byte stream whose key is a salt (0x50676172 "Pgar" for P, 0x4473746C "Dstl" for D)
  absorbing (0, rank, region), indexed by the byte offset inside the region. A D byte that still
  holds its stale value tells "never written" (MISSING, NOT_ZEROED) apart from "written wrong".

Worked number: byte 13 of a 256 B head vector is byte 13 % 8 = 5 (bits 40..47) of
``mix64(key + 2 * GOLDEN)``; byte 13568 of a region's background is byte 0 of word 13568 // 8 = 1696,
``mix64(key + 1697 * GOLDEN)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import KvGeomError

__all__ = ["coordinate_hash", "attention_hash", "state_hash", "pattern_bytes"]

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MUL1 = _U64(0xBF58476D1CE4E5B9)
_MUL2 = _U64(0x94D049BB133111EB)
_SEED_ATTENTION = 0x61_74_74_6E  # "attn"
_SEED_STATE = 0x73_74_61_74  # "stat"
_WORDS_PER_STEP = 1 << 22  # background words per vectorized step: bounds the uint64 temporaries to 32 MiB

# package-internal (not in __all__): the salts the fill and content modules share
SALT_PREFILL = 0x50_67_61_72  # "Pgar": P bytes outside computed coordinates
SALT_DECODE = 0x44_73_74_6C  # "Dstl": D's stale bytes before the transfer


def _mix64(z: Any) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (a bijection of 64-bit integers).

    Written with ufuncs, which wrap modulo 2**64 silently (numpy scalar operators would warn).
    """
    z = np.array(z, dtype=np.uint64)  # a fresh array: the steps below work in place
    np.bitwise_xor(z, np.right_shift(z, _U64(30)), out=z)
    np.multiply(z, _MUL1, out=z)
    np.bitwise_xor(z, np.right_shift(z, _U64(27)), out=z)
    np.multiply(z, _MUL2, out=z)
    np.bitwise_xor(z, np.right_shift(z, _U64(31)), out=z)
    return z


def _absorb(key: Any, field: Any) -> np.ndarray:
    """Fold one non-negative integer field (broadcast) into a key: ``mix64((key ^ field) + GOLDEN)``."""
    f = np.asarray(field, dtype=np.int64).astype(np.uint64)
    return _mix64(np.add(np.bitwise_xor(np.asarray(key, dtype=np.uint64), f), _GOLDEN))


def _stream(key: np.ndarray, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes per key: byte b is byte b % 8 of ``mix64(key + (b // 8 + 1) * GOLDEN)``."""
    words = -(-nbytes // 8)
    steps = np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN
    z = _mix64(np.add(key[..., None], steps))
    return z.astype("<u8", copy=False).view(np.uint8)[..., :nbytes]


def attention_hash(group: int, layer: int, plane: int, token: Any, head: Any, nbytes: int) -> np.ndarray:
    """Bytes of the head vectors at (group, layer, plane, global ``head``, ``token``).

    ``token`` and ``head`` broadcast; the result has their broadcast shape plus a last axis of
    ``nbytes`` (uint8).
    """
    key = _absorb(_absorb(_absorb(_SEED_ATTENTION, group), layer), plane)
    key = _absorb(_absorb(key, head), token)
    return _stream(np.asarray(key), nbytes)


def state_hash(group: int, layer: int, section: int, state_tokens: int, channel: Any, row: Any,
               nbytes: int) -> np.ndarray:
    """Bytes of the state units at (group, layer, section, state tokens, global ``channel``, ``row``)."""
    key = _absorb(_absorb(_absorb(_absorb(_SEED_STATE, group), layer), section), state_tokens)
    key = _absorb(_absorb(key, channel), row)
    return _stream(np.asarray(key), nbytes)


def coordinate_hash(group: int, layer: int, *, nbytes: int, token: Any = None, plane: int | None = None,
                    head: Any = None, section: int | None = None, channel: Any = None, row: Any = None,
                    state_tokens: int | None = None) -> np.ndarray:
    """The bytes a global coordinate holds in the simulator (see the module docstring).

    Attention: give ``token``, ``plane`` and ``head`` (global head index). State: give ``section``
    (index in the StateSpec), ``channel`` (global), ``row`` and ``state_tokens`` (the tokens the
    state has absorbed). Returns uint8 of shape ``broadcast(...) + (nbytes,)``.
    """
    if section is None:
        if token is None or plane is None or head is None:
            raise KvGeomError("coordinate_hash", "an attention coordinate needs token, plane and head",
                              actual={"token": token, "plane": plane, "head": head},
                              fix="pass token=, plane= and head= (or section= for a state)")
        return attention_hash(group, layer, plane, token, head, nbytes)
    if channel is None or row is None or state_tokens is None:
        raise KvGeomError("coordinate_hash", "a state coordinate needs channel, row and state_tokens",
                          actual={"channel": channel, "row": row, "state_tokens": state_tokens},
                          fix="pass channel=, row= and state_tokens= with section=")
    return state_hash(group, layer, section, state_tokens, channel, row, nbytes)


def _pattern_key(salt: int, rank: int, region: int) -> np.ndarray:
    return _absorb(_absorb(_absorb(salt, 0), rank), region)


def pattern_bytes(salt: int, rank: int, region: int, offsets: Any) -> np.ndarray:
    """The background pattern (P garbage or D stale) at byte ``offsets`` of (rank, region)."""
    off = np.asarray(offsets, dtype=np.int64)
    word = np.multiply((off // 8).astype(np.uint64) + _U64(1), _GOLDEN)
    z = _mix64(np.add(_pattern_key(salt, rank, region), word)).reshape(off.shape)
    return (np.right_shift(z, (off % 8).astype(np.uint64) * _U64(8)) & _U64(0xFF)).astype(np.uint8)


def fill_pattern(buf: np.ndarray, salt: int, rank: int, region: int) -> None:
    """Write the whole background stream of (rank, region) into ``buf`` (package-internal).

    The same bytes as ``pattern_bytes(salt, rank, region, arange(buf.size))``, a word at a time.
    """
    key = _pattern_key(salt, rank, region)
    words = -(-buf.size // 8)
    for w0 in range(0, words, _WORDS_PER_STEP):
        w1 = min(words, w0 + _WORDS_PER_STEP)
        z = _mix64(np.add(key, np.multiply(np.arange(w0 + 1, w1 + 1, dtype=np.uint64), _GOLDEN)))
        b0, b1 = w0 * 8, min(buf.size, w1 * 8)
        buf[b0:b1] = z.astype("<u8", copy=False).view(np.uint8)[: b1 - b0]
