"""The values a conformance run writes into vLLM's caches, and how to read them back (docs/design.md §10.6).

* :func:`pattern`: one value per (layer, plane, global head, token, dim) of P's tokens, never 0 and
  never the stale fill, so a misplaced byte is seen; :func:`state_pattern` the same per mamba state
  element.
* :func:`numbers` / :func:`decode_numbers`: small positive ints stored exactly in float32 or
  bfloat16 and read back (token maps and the writer probes).
* :func:`fresh_caches`: scratch caches allocated the way the side's worker allocates them.
"""

from __future__ import annotations

import numpy as np
import torch

from .engines import VllmSide

__all__ = ["pattern", "state_pattern", "numbers", "decode_numbers", "fresh_caches", "MAX_TOKENS"]

MAX_TOKENS = 1024  # the pattern's token axis (values stay exact in float32)


def pattern(layer: int, tokens: torch.Tensor, plane: int, heads: range, head_dim: int,
            total_heads: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A value per (layer, plane, global head, token, dim), never 0 or stale.

    float32: the coordinate's number + 1, exact while ``layers * 2 * total_heads * MAX_TOKENS *
    head_dim < 2**24`` (tiny Llama: 0.5M; MLA: 2.4M). bfloat16 (8-bit mantissa): a 13-bit hash of
    it as the mantissa and low exponent bits of a positive normal number (bits 0x3800 + hash), so
    neighbouring tokens and dims differ; a wrong token differs in almost all of its elements.
    """
    h = torch.tensor(list(heads), dtype=torch.int64).view(1, -1, 1)
    t = tokens.to(torch.int64).view(-1, 1, 1)
    d = torch.arange(head_dim, dtype=torch.int64).view(1, 1, -1)
    code = (((layer * 2 + plane) * total_heads + h) * MAX_TOKENS + t) * head_dim + d
    if dtype == torch.bfloat16:
        bits = 0x3800 + (code * 2654435761 >> 7) % 0x1FFF
        return bits.to(torch.int16).view(torch.bfloat16)
    return (code + 1).to(torch.float32)


def state_pattern(layer: int, section: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A value per (mamba layer, state section, element), never 0 or stale: float32 holds the number + 1
    exactly (layers * 2 * 2**20 < 2**24); other dtypes get its low 13 bits as a positive normal number."""
    n = int(np.prod(shape))
    code = (layer * 2 + section) * (1 << 20) + torch.arange(n, dtype=torch.int64)
    if dtype == torch.float32:
        return (code + 1).to(torch.float32).view(shape)
    return (0x3800 + code % 0x1FFF).to(torch.int16).view(torch.bfloat16).to(dtype).view(shape)


def numbers(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive ints below 2**14 as ``dtype``, recoverable exactly by :func:`decode_numbers`: float32 holds
    the number; bfloat16 holds bits ``0x3F80 + n`` (distinct positive normal numbers)."""
    if dtype == torch.bfloat16:
        return (values.to(torch.int64) + 0x3F80).to(torch.int16).view(torch.bfloat16)
    return values.to(dtype)


def decode_numbers(values: torch.Tensor) -> torch.Tensor:
    """The ints :func:`numbers` stored."""
    if values.dtype == torch.bfloat16:
        return values.contiguous().view(torch.int16).to(torch.int64) - 0x3F80
    return values.to(torch.int64)


def fresh_caches(side: VllmSide, value: float) -> list[dict[str, torch.Tensor]]:
    """One cache per rank of ``side``, allocated as its worker allocates them, filled with ``value``."""
    out = []
    for _ in range(side.tp):
        caches = side.allocate()
        for c in caches.values():
            c.fill_(value)
        out.append(caches)
    return out
