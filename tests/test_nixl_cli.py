"""``kvgeom transfer``: the preset end to end with NIXL, verified by the simulator, as text and JSON."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

from kvgeom import plan_pair  # noqa: E402
from kvgeom.building import DEFAULT_PRESET, get_preset  # noqa: E402
from kvgeom.tools.cli import main  # noqa: E402


@pytest.mark.parametrize("push, mode", [(False, "coalesced"), (True, "prepped")])
def test_run_transfer_json(capsys: Any, push: bool, mode: str) -> None:
    rc = main(["transfer", "--json", "--timeout", "30", "--mode", mode] + (["--push"] if push else []))
    out = json.loads(capsys.readouterr().out)
    preset = get_preset(DEFAULT_PRESET)
    prefix = preset.default_prefix if preset.default_prefix < preset.default_tokens else 0
    pair, request = preset.build(preset.default_tokens, prefix)
    plan = plan_pair(pair, request)
    assert rc == 0 and out["verified"] is True and out["violations"] == [] and out["failure"] is None
    assert (out["tokens"], out["prefix"], out["direction"], out["mode"]) == \
        (preset.default_tokens, prefix, "push" if push else "pull", mode)
    assert out["bytes_moved"] == plan.bytes_copied and out["copies"] == len(plan.copies)
    assert out["nixl_descs"] == len(plan.copies)
    assert out["descriptors_posted"] >= len(plan.copies)
    assert out["bytes_zeroed"] == plan.bytes_zeroed
    assert out["checked_bytes"] == pair.decode.tp * sum(r.nbytes for r in pair.decode.regions)
    assert out["agents"] == pair.prefill.tp + pair.decode.tp
    assert out["transfer_s"] > 0 and out["wall_s"] >= out["transfer_s"]


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_run_transfer_packed_json(capsys: Any, push: bool) -> None:
    rc = main(["transfer", "--json", "--strategy", "packed", "--timeout", "30"] + (["--push"] if push else []))
    out = json.loads(capsys.readouterr().out)
    preset = get_preset(DEFAULT_PRESET)
    prefix = preset.default_prefix if preset.default_prefix < preset.default_tokens else 0
    pair, request = preset.build(preset.default_tokens, prefix)
    plan = plan_pair(pair, request, strategy="packed")
    assert rc == 0 and out["verified"] is True and out["packed"] is True
    assert out["wire_descriptors"] == len(plan.wire) == out["descriptors_posted"] == out["nixl_descs"] == 4
    assert out["bytes_moved"] == plan.bytes_copied == out["bytes"] and out["chunks"] == 1
    assert out["pack_s"] > 0 and out["wire_s"] > 0 and out["unpack_s"] > 0
    assert out["staging_slot_bytes"] >= int(plan.staging_used("prefill").max())


def test_run_transfer_text_on_a_hybrid(capsys: Any) -> None:
    rc = main(["transfer", "--preset", "nemotron-h-tp4-tp1", "--tokens", "64", "--layers", "1", "--timeout", "30"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "verdict: OK" in text and "nemotron-h-tp4-tp1, M=64 S=0, pull, mode coalesced" in text
    assert "0 violation runs" in text


def test_kvgeom_main_runs_the_transfer(capsys: Any) -> None:
    rc = main(["transfer", "--tokens", "48", "--prefix", "0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["verified"] and out["tokens"] == 48


@pytest.mark.parametrize("strategy", ["direct", "packed"])
def test_plan_and_transfer_json_name_the_plan_alike(capsys: Any, strategy: str) -> None:
    """Issue 20 (7): the plan's totals carry the same keys and values in both commands, and the
    text summary of a packed transfer names its wire rows and bytes (not ``0 copies``)."""
    argv = ["--preset", DEFAULT_PRESET, "--tokens", "48", "--layers", "2", "--strategy", strategy]
    assert main(["plan", "--json", *argv]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["transfer", "--json", "--timeout", "30", *argv]) == 0
    moved = json.loads(capsys.readouterr().out)
    keys = ("copies", "copies_before_coalescing", "bytes", "zeros", "zero_bytes", "rearranges", "packed",
            "wire_descriptors", "chunks", "packs", "unpacks", "staging_bytes", "layers", "tokens", "prefix")
    assert {k: moved[k] for k in keys} == {k: planned[k] for k in keys}
    assert moved["layers"] == 2 and moved["bytes"] == moved["bytes_moved"] > 0
    assert moved["wire_descriptors"] == moved["descriptors_posted"]  # what the plan posts is what was posted
    assert main(["transfer", "--timeout", "30", *argv]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("  plan: "))
    if strategy == "packed":
        assert line.startswith(f"  plan: {planned['wire_descriptors']} wire rows in 1 chunk / ") and " 0 copies" not in line
    assert f"/ {planned['bytes']:,} B" in line  # the plan's own bytes (48 - 16 tokens of 2 layers)
