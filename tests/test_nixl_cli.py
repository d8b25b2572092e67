"""``kvgeom transfer``: the preset end to end with NIXL, verified by the simulator, as text and JSON."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
pytest.importorskip("nixl._api", reason="nixl is not installed (pip install 'kvgeom[nixl]')")
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
    assert out["bytes_moved"] == plan.bytes_copied and out["plan_copies"] == len(plan.copies)
    assert out["nixl_descs"] == len(plan.copies)
    assert out["descriptors"] >= len(plan.copies)
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
    assert rc == 0 and out["verified"] is True and out["plan_packed"] is True
    assert out["wire_descriptors"] == len(plan.wire) == out["plan_wire_rows"] == out["nixl_descs"] == 4
    assert out["bytes_moved"] == plan.bytes_copied and out["plan_chunks"] == 1
    assert out["pack_s"] > 0 and out["wire_s"] > 0 and out["unpack_s"] > 0
    assert out["staging_bytes"] >= int(plan.staging_used("prefill").max())


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
