"""Token alignment: cut a token range into segments that each side stores with one affine map.

Tokens are aligned by position. Each side stores token ``t`` of a listing (ids, first token,
K tokens per kernel page, ppl pages per logical block) at::

    i = t - first;  kernel page = ids[i // (K*ppl)] * ppl + (i % (K*ppl)) // K;  slot = i % K

A segment ends wherever either side's address stops being affine in ``t``: at every kernel page
boundary, or, when a side's pages are token-outermost (``page_bytes == K * token_stride``, e.g.
MLA or per-plane NHD), only where its consecutive pages stop being consecutive ids::

    tokens     0        8        16       24       32
    P (K=8)    |  p5    |  p1    |  p6    |  p2    |
    D (K=16)   |       d4        |       d5        |
    segments   [0,8)    [8,16)   [16,24)  [24,32)       -> 4 segments, each inside one page per side

Worked number: P K=12, D K=8, tokens [0, 48): P cuts at 12, 24, 36; D at 8, 16, 24, 32, 40; the
union gives 8 segments [0,8) [8,12) [12,16) [16,24) [24,32) [32,36) [36,40) [40,48).

A side whose tokens are sharded over ``cp`` decode-context-parallel ranks (docs/design.md §11.2)
stores token ``t`` on rank ``((t - first) // I) % cp``, in a kernel page that covers ``K * cp``
tokens; its address is affine only inside one chunk of ``I`` tokens, so it cuts at every multiple
of ``I``. With ``cp = 8``, ``K = 64``, ``I = 1``, token 1000 of a listing from 0 is on rank 0, slot 61.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

__all__ = ["SideTokens", "Segments", "segments", "locate", "window_start"]


def window_start(computed_tokens: int, window_tokens: int | None) -> int:
    """The first token a sliding-window group still needs after ``computed_tokens`` tokens.

    The ONE place this rule lives (the planner's needed range, the simulator's needed bytes,
    coverage checks, :func:`kvgeom.fresh_request`, the strategies and the block-table constructor
    all ask it): ``max(0, M - W + 1)``. A window of ``W`` tokens includes the query's own token,
    so the next token D computes, token ``M``, attends to keys ``[M - W + 1, M]`` and D needs the
    cached ``W - 1`` tokens ``[M - W + 1, M)``. That is vLLM's convention: its FlashAttention
    backends pass ``window_size = (W - 1, 0)`` (W - 1 keys to the left of the query, none to the
    right), and its sliding-window KV cache manager frees ``num_computed_tokens - W + 1`` skipped
    tokens (docs/design.md §3.4). A full-attention group (``window_tokens`` None) needs every
    token from 0.

    >>> window_start(100, 16), window_start(10, 16), window_start(100, None), window_start(16, 16)
    (85, 0, 0, 1)
    """
    if window_tokens is None:
        return 0
    return max(0, computed_tokens - window_tokens + 1)


def locate(block_ids: np.ndarray, first_token: int, kernel_tokens: int, pages_per_block: int,
           tokens: np.ndarray, cp: int = 1, interleave: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(kernel page, slot) of each of ``tokens`` in a listing (logical ``block_ids`` from ``first_token``).

    With ``cp`` > 1 the slot is the one on the token's owner, ``((t - first) // interleave) % cp``
    (docs/design.md §11.2): a kernel page covers ``K * cp`` tokens, ``K`` on each rank.

    >>> locate(np.array([7, 3]), 0, 8, 3, np.array([30]))   # block 3 (30 // 24 = 1), page 3*3 + 6 // 8
    (array([9]), array([6]))
    >>> locate(np.array([4, 9]), 0, 64, 1, np.array([1000]), cp=8)   # o = 488: owner 0, slot 61
    (array([9]), array([61]))
    """
    i = np.asarray(tokens, dtype=np.int64) - first_token
    span = kernel_tokens * cp  # request tokens one kernel page covers
    block_tokens = span * pages_per_block
    page = np.asarray(block_ids, dtype=np.int64)[i // block_tokens] * pages_per_block + (i % block_tokens) // span
    if cp == 1:
        return page, i % kernel_tokens
    o = i % span
    return page, (o // (cp * interleave)) * interleave + o % interleave


@attrs.frozen
class SideTokens:
    """One side's listing of one group, in kernel terms."""

    block_ids: np.ndarray  # logical ids, int64
    first_token: int
    kernel_tokens: int
    pages_per_block: int
    linear: bool  # pages are token-outermost: consecutive page ids continue the token stride
    cut_tokens: int = 0  # cut every this many tokens instead of every page (0: kernel_tokens)
    cp: int = 1  # decode context parallel ranks the tokens are sharded over (docs/design.md §11.2)
    interleave: int = 1  # tokens per chunk on one of them

    @property
    def block_tokens(self) -> int:
        """Request tokens one logical block covers (``K * ppl * cp``)."""
        return self.kernel_tokens * self.pages_per_block * self.cp

    def owner(self, t: np.ndarray) -> np.ndarray:
        """The dcp rank holding each token (all 0 without DCP)."""
        t = np.asarray(t, dtype=np.int64)
        if self.cp == 1:
            return np.zeros(t.shape, np.int64)
        return ((t - self.first_token) // self.interleave) % self.cp

    def cuts(self, lo: int, hi: int) -> np.ndarray:
        """Token positions in ``(lo, hi)`` where this side's address stops being affine."""
        K, B, f = self.kernel_tokens, self.block_tokens, self.first_token
        if self.cp > 1:  # every chunk of `interleave` tokens (page boundaries are multiples of it)
            step = self.interleave
            start = f + ((lo - f) // step + 1) * step
            return np.arange(start, hi, step, dtype=np.int64)
        if not self.linear:
            step = self.cut_tokens or K
            start = f + ((lo - f) // step + 1) * step
            return np.arange(start, hi, step, dtype=np.int64)
        # only logical-block boundaries whose next id is not the next page run
        i0 = (lo - f) // B + 1
        i1 = -(-(hi - f) // B)  # blocks whose start lies before hi
        idx = np.arange(i0, i1, dtype=np.int64)
        idx = idx[(idx >= 1) & (idx < len(self.block_ids))]
        jump = self.block_ids[idx] != self.block_ids[idx - 1] + 1
        return f + idx[jump] * B

    def locate(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(kernel page, slot) of tokens ``t`` (on their owner, with DCP)."""
        return locate(self.block_ids, self.first_token, self.kernel_tokens, self.pages_per_block, t, self.cp,
                      self.interleave)


@attrs.frozen
class Segments:
    """Token segments ``[start, start+length)`` with each side's (page, slot) at ``start``."""

    start: np.ndarray
    length: np.ndarray
    page: tuple[np.ndarray, ...]
    slot: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return len(self.start)

    def take(self, index: np.ndarray) -> Segments:
        return Segments(self.start[index], self.length[index], tuple(p[index] for p in self.page),
                        tuple(s[index] for s in self.slot))


def segments(lo: int, hi: int, sides: Sequence[SideTokens]) -> Segments:
    """Cut ``[lo, hi)`` at every side's cuts; each piece is affine on every side."""
    if hi <= lo:
        z = np.zeros(0, np.int64)
        return Segments(z, z, tuple(z for _ in sides), tuple(z for _ in sides))
    pts = np.unique(np.concatenate([np.array([lo, hi], np.int64)] + [s.cuts(lo, hi) for s in sides]))
    start = pts[:-1]
    length = np.diff(pts)
    located = [s.locate(start) for s in sides]
    return Segments(start, length, tuple(p for p, _ in located), tuple(s for _, s in located))
