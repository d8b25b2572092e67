"""A connector's receive-side steps in kvgeom's terms: vLLM's page regrouping as a ``Rearrange``.

When D's block holds ``ratio`` of P's blocks, vLLM's NIXL connector READs P's blocks one after the
other into D's block and then regroups the page in place (``kv_postprocess_blksize_on_receive``,
and ``kv_postprocess_blksize_and_layout_on_receive`` when it also turns P's head-major pages into
D's token-major ones). On a page of ``H`` heads, ``N = ratio * n`` tokens and cells of ``C`` bytes
(one (head, token) cell: K then V, or an MLA latent)::

    arrived   [P block 0: H x n x C][P block 1: H x n x C] ...      element (j, h, t) at (j*H*n + h*n + t) * C
    LBHNC     [H x N x C]                                            token j*n + t of head h at (h*N + j*n + t) * C
    LBNHC     [N x H x C]                                            at ((j*n + t)*H + h) * C

:func:`regroup_rearrange` writes that permutation as a :class:`~kvgeom.values.plan.Rearrange` over
the listed pages of one (D rank, region), for :func:`~kvgeom.conformance.rows.rows_from_descriptors`'
``rearranges=``; :func:`page_tail_zeros` writes vLLM's zeroing of a page's tokens ``[t, N)``
(``cache[block, :, t:].zero_()``) as the zero ranges ``zeros=`` takes. It models what the connector does to the bytes, not what the page is: a page
whose cells are not ``C`` contiguous bytes per (head, token) (the CPU backend's ``[head][K rows][V
rows]``) is regrouped wrongly by vLLM, and the kit then reports that as WRONG_DATA.

Worked number: 2 heads, D page of 8 tokens, P blocks of 4 (ratio 2), cells of 16 B (a 128 B
half-page per P block): P block 1, head 0, token 2 arrives at ``(1*2*4 + 0*4 + 2) * 16 = 160`` and
moves to D token ``1*4 + 2 = 6`` of head 0, ``(0*8 + 6) * 16 = 96`` (LBHNC).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..arith.ints import checked_product
from ..errors import PlanError, value_text
from ..values.fields import check_int
from ..values.plan import Rearrange

__all__ = ["regroup_rearrange", "page_tail_zeros", "VLLM_PAGE_ORDERS"]

VLLM_PAGE_ORDERS = ("LBHNC", "LBNHC")
"""D page orders :func:`regroup_rearrange` writes: head-major ``[H, N, C]`` or token-major ``[N, H, C]``."""


def regroup_rearrange(d_rank: int, d_region: int, pages: Sequence[int], *, heads: int, tokens: int,
                      cell_bytes: int, ratio: int, page_bytes: int, offset: int = 0,
                      local_order: str = "LBHNC") -> Rearrange:
    """vLLM's receive-side regrouping of ``ratio`` arrived P blocks into one D page, on ``pages``.

    ``heads``, ``tokens`` (D's kernel-page tokens, a multiple of ``ratio``) and ``cell_bytes``
    describe the layer's ``[H, N, C]`` page, which starts ``offset`` bytes into each region page of
    ``page_bytes``; ``local_order`` is D's page order (``"LBHNC"``: vLLM's
    ``kv_postprocess_blksize_on_receive``; ``"LBNHC"``: ``..._blksize_and_layout_on_receive``).
    Raises :class:`~kvgeom.errors.PlanError` naming the argument.
    """
    heads = check_int("heads", heads, minimum=1, error=PlanError)
    tokens = check_int("tokens", tokens, minimum=1, error=PlanError)
    cell = check_int("cell_bytes", cell_bytes, minimum=1, error=PlanError)
    ratio = check_int("ratio", ratio, minimum=1, error=PlanError)
    page_bytes = check_int("page_bytes", page_bytes, minimum=1, error=PlanError)
    offset = check_int("offset", offset, minimum=0, error=PlanError)
    if not isinstance(local_order, str) or local_order not in VLLM_PAGE_ORDERS:
        raise PlanError("local_order", f"unknown page order {value_text(local_order, 60)}",
                        actual=value_text(local_order, 60), expected=list(VLLM_PAGE_ORDERS),
                        fix="D's resolved kv_cache_layout: LBHNC or LBNHC")
    if tokens % ratio:
        raise PlanError("ratio", f"{ratio} P blocks do not split a {tokens}-token D page", actual=ratio,
                        expected=f"a divisor of {tokens}", fix="ratio = D block tokens / P block tokens")
    n = tokens // ratio
    layer = checked_product("heads", heads, tokens, cell, what="bytes of the layer's page", error=PlanError)
    if offset + layer > page_bytes:
        raise PlanError("page_bytes", f"a {layer} B layer page at offset {offset} overruns a {page_bytes} B page",
                        actual=page_bytes, expected=f">= {offset + layer}", fix="pass the region's page bytes")
    src = (heads * n * cell, n * cell, cell)
    dst = (n * cell, tokens * cell, cell) if local_order == "LBHNC" else (n * heads * cell, cell, heads * cell)
    return Rearrange(d_rank, d_region, tuple(pages), (ratio, heads, n), src, dst, cell, offset, offset,
                     page_bytes=page_bytes)


def page_tail_zeros(d_rank: int, page_address: int, *, heads: int, tokens: int, cell_bytes: int, from_token: int,
                    local_order: str = "LBHNC") -> list[tuple[int, int, int]]:
    """The ``(d_rank, address, nbytes)`` ranges that zero tokens ``[from_token, tokens)`` of every head of
    one ``[H, N, C]`` page at ``page_address`` (vLLM: ``cache[block, :, from_token:].zero_()``): one range
    per head in LBHNC, one range in LBNHC. Raises :class:`~kvgeom.errors.PlanError` naming the argument."""
    d_rank = check_int("d_rank", d_rank, minimum=0, error=PlanError)
    page_address = check_int("page_address", page_address, minimum=0, error=PlanError)
    heads = check_int("heads", heads, minimum=1, error=PlanError)
    tokens = check_int("tokens", tokens, minimum=1, error=PlanError)
    cell = check_int("cell_bytes", cell_bytes, minimum=1, error=PlanError)
    start = check_int("from_token", from_token, minimum=0, error=PlanError)
    if start >= tokens:
        return []
    if local_order == "LBNHC":
        return [(d_rank, page_address + start * heads * cell, (tokens - start) * heads * cell)]
    if local_order != "LBHNC":
        raise PlanError("local_order", f"unknown page order {value_text(local_order, 60)}",
                        actual=value_text(local_order, 60), expected=list(VLLM_PAGE_ORDERS),
                        fix="D's resolved kv_cache_layout: LBHNC or LBNHC")
    return [(d_rank, page_address + (h * tokens + start) * cell, (tokens - start) * cell) for h in range(heads)]
