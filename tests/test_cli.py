"""The command line, run in-process through ``kvgeom.tools.cli.main`` (plus one ``python -m kvgeom`` run).

Expected byte counts are arithmetic on the presets' model facts:
default preset gqa-tp2-tp4, M=100, S=16, 4 layers, 8 KV heads of 256 B, K and V planes:
D receives tokens [16, 100): 84 * 4 * 2 * 8 * 256 = 1,376,256 B, a quarter per D rank (344,064 B).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgeom.building import DEFAULT_PRESET, PRESETS, get_preset
from kvgeom.tools import cli, serialize
from kvgeom.tools.cli import COMMANDS, Command, main

DEFAULT_BYTES = (100 - 16) * 4 * 2 * 8 * 256


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc, out, _ = _run(capsys, *argv)
    return rc, json.loads(out)


# ---- kvgeom presets -------------------------------------------------------------------------------

def test_presets_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "presets")
    assert rc == 0 and err == ""
    for name, preset in PRESETS.items():
        assert name in out
        assert preset.description[:40] in out
    assert f"{DEFAULT_PRESET} (default)" in out


def test_presets_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _json(capsys, "presets", "--json")
    assert rc == 0 and doc["default"] == DEFAULT_PRESET
    assert [p["name"] for p in doc["presets"]] == list(PRESETS)


# ---- kvgeom plan ------------------------------------------------------------------------------------

def test_plan_default_human_summary(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "plan")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"kvgeom plan: preset {DEFAULT_PRESET}: M=100 tokens, prefix S=16")
    assert lines[1].strip().startswith("P  prefill:") and "TP2 K=16" in lines[1]
    assert lines[2].strip().startswith("D  decode:") and "TP4 K=8" in lines[2]
    rank_rows = [line.split() for line in lines if line.strip()[:1].isdigit() and len(line.split()) == 7]
    assert [r[0] for r in rank_rows] == ["0", "1", "2", "3"]
    assert {r[3] for r in rank_rows} == {f"{DEFAULT_BYTES // 4:,}"}  # bytes column per D rank
    assert any(line.strip().startswith("total") and f"{DEFAULT_BYTES:,}" in line for line in lines)
    assert any(line.startswith("descriptors:") and "before coalescing" in line for line in lines)
    assert lines[-1].startswith("verdict: OK")
    # issue 20 (8): the terms the summary uses are explained where they are printed
    legend = out[out.index("legend: "):]
    for term in ("K = ", "ppl = ", "rearranged pages = ", "aligned segments = ", "checked = ", "exceeds moved"):
        assert term in legend, term


def test_plan_default_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _json(capsys, "plan", "--json")
    assert rc == 0
    assert doc["pairable"] is True and doc["verified"] is True and doc["violations"] == []
    assert (doc["preset"], doc["tokens"], doc["prefix"], doc["strategy"]) == (DEFAULT_PRESET, 100, 16, "direct")
    assert doc["bytes"] == DEFAULT_BYTES
    assert 1 <= doc["copies"] <= doc["copies_before_coalescing"]
    # D tokens [100, 104) of the last 8-token block are zeroed: 4 tokens * 4 layers * 2 planes * 8 heads * 256 B
    zero_bytes = sum(r["zero_bytes"] for r in doc["per_decode_rank"])
    assert zero_bytes == 4 * 4 * 2 * 8 * 256
    assert doc["zeros"] >= 1 and isinstance(doc["notes"], list)
    assert [r["p_ranks"] for r in doc["per_decode_rank"]] == [[0], [0], [1], [1]]  # heads [2d, 2d+2) of P d//2


@pytest.mark.parametrize(("argv", "expected_bytes"), [
    # 64 tokens x 2 layers x 2 planes x 8 heads x 256 B
    (["--preset", "llama3-70b-tp8-tp4", "--layers", "2", "--tokens", "64"], 64 * 2 * 2 * 8 * 256),
    (["--preset", "llama3-70b-tp4-tp8", "--layers", "2", "--tokens", "40"], 40 * 2 * 2 * 8 * 256),
    # MLA: one 1152 B latent per token per layer, read once per D rank (TP1)
    (["--preset", "deepseek-v3-tp8-tp1", "--layers", "2", "--tokens", "130"], 130 * 2 * 1152),
    # attention 2 layers x 300 tokens x 2 x 8 x 256 + mamba 2 layers x 4,255,744 B whole states
    (["--preset", "nemotron-h-tp1-tp4"], 300 * 2 * 2 * 8 * 256 + 2 * 4_255_744),
])
def test_plan_presets_verify(capsys: pytest.CaptureFixture[str], argv: list[str], expected_bytes: int) -> None:
    rc, doc = _json(capsys, "plan", *argv, "--json")
    assert rc == 0, doc["violations"]
    assert doc["verified"] is True and doc["bytes"] == expected_bytes


@pytest.mark.parametrize(("argv", "expected_bytes", "sources"), [
    # P PP2 x TP4 -> D TP8: head d of D rank d lives on P tp rank d // 2 of both stages (flat 4 * stage + tp)
    (["--preset", "llama3-70b-pp2tp4-tp8", "--layers", "2", "--tokens", "64"], 64 * 2 * 2 * 8 * 256,
     [[d // 2, 4 + d // 2] for d in range(8)]),
    # MLA TP8 -> TP8 DCP8 with 64-token chunks: 600 tokens reach every D rank, rank d reads from P rank d
    (["--preset", "deepseek-v3-tp8-dcp8", "--layers", "2", "--tokens", "600"], 600 * 2 * 1152,
     [[d] for d in range(8)]),
    # DCP4 -> DCP2 on TP8: keys q = d // 2 + d % 2 pick head group (q % 2) * 4, tokens by parity; D keeps
    # tp // dcp = 4 copies of the latent (one per head group), each split over its 2 DCP ranks
    (["--preset", "deepseek-v3-dcp4-dcp2", "--layers", "2"], 4 * 300 * 2 * 1152,
     [[0, 2], [5, 7], [4, 6], [1, 3], [0, 2], [5, 7], [4, 6], [1, 3]]),
    # KimiLinear PP2 x TP4 -> TP1, default 2 layers per group (6 global layers, 3 per stage):
    # latents 1000 tokens x 2 layers x 1152 B + 2 KDA groups x 2 layers x a whole TP1 state of
    # 3 conv sections x 4096 channels x 3 rows x 2 B + 32 heads x 128 x 128 x 4 B = 2,170,880 B
    (["--preset", "kimi-linear-pp2tp4-tp1"], 1000 * 2 * 1152 + 2 * 2 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4),
     [list(range(8))]),
])
def test_plan_topology_presets_verify(capsys: pytest.CaptureFixture[str], argv: list[str], expected_bytes: int,
                                      sources: list[list[int]]) -> None:
    rc, doc = _json(capsys, "plan", *argv, "--json")
    assert rc == 0, doc["violations"]
    assert doc["verified"] is True and doc["bytes"] == expected_bytes
    assert [r["p_ranks"] for r in doc["per_decode_rank"]] == sources
    assert "topology" in doc["note_kinds"]


def test_plan_unpairable_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--preset", "unpairable-fp8")
    assert rc == 2
    assert "not pairable (2 reasons)" in out
    assert "head_bytes: 128 != prefill's 256" in out and "decode.model.dtype" in out


def test_plan_unpairable_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _json(capsys, "plan", "--preset", "unpairable-fp8", "--json")
    assert rc == 2
    assert doc["pairable"] is False and doc["verified"] is False and doc["violations"] == []
    assert {r["path"] for r in doc["reasons"]} == {"decode.model.dtype", "decode.model.groups[0](attn).head_bytes"}


def test_plan_unknown_preset_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "plan", "--preset", "nope")
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "no preset named 'nope'" in err and DEFAULT_PRESET in err


def test_plan_prefix_off_block_boundary_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "plan", "--prefix", "12")  # D blocks are 8 tokens
    assert rc == 2
    assert "Request.prefix_hit_tokens" in err and "multiple of 8" in err
    assert "Traceback" not in err


def test_plan_error_with_json_prints_error_object(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "plan", "--tokens", "0", "--json")
    assert rc == 2 and "tokens" in err
    assert json.loads(out)["error"]["path"] == "tokens"


def test_plan_bad_strategy_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "plan", "--strategy", "magic")
    assert rc == 2 and "invalid choice" in err


@pytest.mark.parametrize("strategy", ["staged", "auto", "packed"])
def test_plan_other_strategies(capsys: pytest.CaptureFixture[str], strategy: str) -> None:
    rc, out, err = _run(capsys, "plan", "--strategy", strategy, "--json")
    assert rc == 0 and json.loads(out)["verified"] is True


def test_plan_packed_json_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """The default preset packed (docs/design.md §12.2): 4 wire rows; each D rank stages
    84 tokens x 4 layers x 2 planes x 2 heads x 256 B, each P rank twice that; a 400 KiB slot cuts
    the request in chunks."""
    rc, out, _ = _run(capsys, "plan", "--strategy", "packed", "--json")
    doc = json.loads(out)
    block = 84 * 4 * 2 * 2 * 256
    assert rc == 0 and doc["verified"] and doc["packed"] and doc["wire_descriptors"] == 4 and doc["chunks"] == 1
    assert doc["staging_per_decode_rank"] == [block] * 4 and doc["staging_per_prefill_rank"] == [2 * block] * 2
    assert doc["bytes"] == 4 * block and "packed" in doc["note_kinds"] and "chunks" in doc["note_kinds"]
    rc, out, _ = _run(capsys, "plan", "--strategy", "packed", "--staging-bytes", str(400 << 10))
    assert rc == 0 and "wire rows in 2 chunks" in out and "verdict: OK" in out
    rc, _, err = _run(capsys, "plan", "--strategy", "packed", "--staging-bytes", "100")
    assert rc == 2 and "staging_bytes" in err and "StagingCapacity" not in err  # a one-line typed error


def test_plan_internal_error_one_line_then_traceback_only_with_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "plan_pair", boom)
    rc, _, err = _run(capsys, "plan")
    assert rc == 1
    assert err.splitlines()[0].startswith("kvgeom plan: internal error: RuntimeError: boom")
    assert "Traceback" not in err
    rc, _, err = _run(capsys, "plan", "--debug")
    assert rc == 1
    assert err.splitlines()[0].startswith("kvgeom plan: internal error: RuntimeError: boom")
    assert "Traceback" in err


def test_plan_reports_violations_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan that drops its zeros must be caught by the simulator, and the CLI must say so."""
    import attrs

    from kvgeom import Zeros, plan_pair

    def no_zeros(*args: Any, **kwargs: Any) -> Any:
        return attrs.evolve(plan_pair(*args, **kwargs), zeros=Zeros.empty())

    monkeypatch.setattr(cli, "plan_pair", no_zeros)
    rc, out, _ = _run(capsys, "plan")
    assert rc == 1
    assert "verdict: FAILED" in out and "not_zeroed" in out
    rc, doc = _json(capsys, "plan", "--json")
    assert rc == 1 and doc["verified"] is False and doc["violations"]


def test_plan_pair_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pair, request = PRESETS[DEFAULT_PRESET].build(40, 8, layers=1)
    with_request = tmp_path / "pair.json"
    with_request.write_text(serialize.dump_pair_file(pair, request))
    rc, doc = _json(capsys, "plan", "--pair", str(with_request), "--json")
    assert rc == 0 and doc["verified"] is True
    assert (doc["pair_file"], doc["preset"], doc["tokens"], doc["prefix"]) == (str(with_request), None, 40, 8)
    assert doc["bytes"] == (40 - 8) * 1 * 2 * 8 * 256
    without = tmp_path / "engines.json"
    without.write_text(serialize.dump_pair_file(pair))
    rc, doc = _json(capsys, "plan", "--pair", str(without), "--tokens", "24", "--json")
    assert rc == 0 and doc["bytes"] == 24 * 2 * 8 * 256
    # issue 20 (8): without a request in the file and without --tokens, nothing is planned by default
    rc, _, err = _run(capsys, "plan", "--pair", str(without))
    assert rc == 2 and "holds two engines and no request" in err and "--tokens M" in err
    rc, _, err = _run(capsys, "plan", "--pair", str(tmp_path / "missing.json"))
    assert rc == 2 and "cannot read pair file" in err


def test_plan_pair_file_unpairable(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prefill, decode = PRESETS["unpairable-fp8"].geometries()
    doc = {"schema": serialize.SCHEMA_VERSION, "type": "PairFile", "prefill": serialize.to_dict(prefill),
           "decode": serialize.to_dict(decode)}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = _run(capsys, "plan", "--pair", str(path))
    assert rc == 2 and "not pairable" in out and "head_bytes" in out


def test_plan_drawing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.svg"
    rc, out, err = _run(capsys, "plan", "--layers", "1", "--tokens", "32", "--svg", str(target))
    try:
        import matplotlib  # noqa: F401

        import kvgeom.show.drawing  # noqa: F401
    except ImportError:
        assert rc == 2 and ("kvgeom.show.drawing" in err or "matplotlib" in err) and not target.exists()
        return
    assert rc == 0, err
    assert target.read_text()[:200].lstrip().startswith(("<?xml", "<svg"))


# ---- kvgeom transfer ------------------------------------------------------------------------------

class _FakeEntryPoint:
    """What ``importlib.metadata.entry_points`` yields: a name and ``load()``."""

    def __init__(self, name: str, target: Any) -> None:
        self.name = name
        self._target = target

    def load(self) -> Any:
        return self._target


def test_transfer_without_executor_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    monkeypatch.setattr(cli, "_missing_modules", lambda names: [])
    rc, _, err = _run(capsys, "transfer", "--tokens", "16")
    assert rc == 2 and cli.NIXL_HINT in err and "kvgeom.transfer" in err
    monkeypatch.setattr(cli, "_missing_modules", lambda names: ["nixl"])
    rc, _, err = _run(capsys, "transfer")
    assert rc == 2 and "needs nixl" in err and cli.NIXL_HINT in err


def test_install_hints_follow_how_kvgeom_was_installed(tmp_path: Path) -> None:
    """Issue 20 (8): from a wheel (no checkout around the package) the hint is ``pip install
    "kvgeom[extra]"``; from this checkout an editable install of it (any working directory)."""
    import os
    import shutil

    from kvgeom.errors import install_hint

    root = Path(__file__).resolve().parent.parent
    assert install_hint("notebook") == f'pip install -e "{root}[notebook]"'
    site = tmp_path / "site-packages"  # kvgeom as a wheel lays it out: the package, no pyproject.toml
    shutil.copytree(root / "kvgeom", site / "kvgeom", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-c", "from kvgeom.tools.cli import NIXL_HINT; "
                           "from kvgeom.errors import install_hint; print(install_hint('notebook'), NIXL_HINT)"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                          timeout=120, check=True)
    assert done.stdout.split("\n")[0] == 'pip install "kvgeom[notebook]" pip install "kvgeom[nixl]"'


def test_transfer_is_registered_as_an_entry_point() -> None:
    """The installed distribution registers kvgeom_nixl's executor where the CLI looks for it."""
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group=cli.TRANSFER_ENTRY_POINTS)}
    assert found == {"nixl": "kvgeom_nixl.cli:transfer_report"}


def test_transfer_hands_its_arguments_to_the_executor(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_report(preset: str, tokens: int, prefix: int, **options: Any) -> dict[str, Any]:
        seen.update(options, preset=preset, tokens=tokens, prefix=prefix)
        return {"verified": True}

    groups: list[str] = []
    monkeypatch.setattr(cli, "entry_points", lambda group: groups.append(group) or [_FakeEntryPoint("x", fake_report)])
    monkeypatch.setattr(cli, "_missing_modules", lambda names: [])
    rc, out, _ = _run(capsys, "transfer", "--preset", "nemotron-h-tp1-tp4", "--tokens", "64", "--push",
                      "--mode", "prepped", "--json", "--timeout", "5")
    assert rc == 0 and json.loads(out) == {"verified": True} and groups == [cli.TRANSFER_ENTRY_POINTS]
    assert (seen["preset"], seen["tokens"], seen["push"], seen["mode"], seen["timeout_s"]) == (
        "nemotron-h-tp1-tp4", 64, True, "prepped", 5.0)
    preset_prefix = get_preset("nemotron-h-tp1-tp4").default_prefix
    assert seen["prefix"] == (preset_prefix if preset_prefix < 64 else 0)
    assert seen["layers"] is None and seen["strategy"] == "direct" and seen["staging_bytes"] == 256 << 20


# ---- registry, help, entry points ----------------------------------------------------------------

def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys)
    assert rc == 2 and "plan" in out and "presets" in out


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--help")
    assert rc == 0 and "--strategy" in out and "--pair" in out and "--svg" in out


def test_a_registered_command_runs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def add_arguments(parser: Any) -> None:
        parser.add_argument("--answer", type=int, default=0)

    def run(args: Any) -> int:
        print(f"answer {args.answer}")
        return int(args.answer)

    monkeypatch.setitem(COMMANDS, "fake", Command("a test command", add_arguments, run))
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0 and "fake" in out
    rc, out, _ = _run(capsys, "fake", "--answer", "3")
    assert rc == 3 and out.strip() == "answer 3"


def test_fuzz_help_needs_no_hypothesis(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_missing_modules", lambda names: list(names))
    rc, out, _ = _run(capsys, "fuzz", "--help")
    assert rc == 0 and "--examples" in out
    rc, _, err = _run(capsys, "fuzz", "--examples", "1")
    assert rc == 2 and "needs hypothesis" in err and "[testing]" in err


def test_python_dash_m_kvgeom() -> None:
    done = subprocess.run([sys.executable, "-m", "kvgeom", "plan", "--preset", "unpairable-fp8", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert json.loads(done.stdout)["pairable"] is False


def test_plan_refuses_an_unwritable_drawing_path_before_planning(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "plan", "--svg", "/nonexistent-kvgeom-dir/x.svg")
    assert rc == 2 and "--svg" in err and "/nonexistent-kvgeom-dir" in err and "verdict" not in out


@pytest.mark.parametrize(("flag", "name", "use"), [("--svg", "x.png", "--png"), ("--png", "x.svg", "--svg"),
                                                   ("--png", "x.pdf", None)])
def test_a_drawing_path_naming_another_format_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         flag: str, name: str, use: str | None) -> None:
    """Issue 20 (8): ``--svg x.png`` wrote SVG into a .png; now refused before anything is written."""
    target = tmp_path / name
    rc, _, err = _run(capsys, "plan", "--layers", "1", "--tokens", "16", flag, str(target))
    assert rc == 2 and f"{flag}:" in err and not target.exists()
    if use:
        assert f"use {use} {target}" in err
    rc, _, _ = _run(capsys, "plan", "--layers", "1", "--tokens", "16", flag, str(tmp_path / "plain"))
    assert rc == 0  # no image suffix: the flag decides


def test_an_allocation_beyond_the_machine_does_not_suggest_raising_the_budget(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20 (8): ``--tokens 100000000`` suggested ``--budget-mb 6250001`` (6 TB); one that fits
    the machine still names the budget that admits it."""
    from kvgeom.tools.limits import machine_bytes

    have = machine_bytes()
    assert have is not None and have < 6_000 * 2**30
    rc, _, err = _run(capsys, "plan", "--tokens", "100000000")
    assert rc == 2 and "raising --budget-mb will not help" in err and "--budget-mb 6250001" not in err
    rc, _, err = _run(capsys, "plan", "--tokens", "100000")  # 6.1 GiB: over the default budget, not the machine
    if have > 7 * 2**30:
        assert rc == 2 and "raise the budget with --budget-mb 6251" in err


def test_transfer_finds_nixl_as_one_cuda_flavour(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20 (9): ``dev`` installs nixl-cu13 alone (no ``nixl`` meta package); that is NIXL too."""
    present = {"torch", "nixl_cu13"}
    monkeypatch.setattr(cli, "_missing_modules", lambda names: [n for n in names if n not in present])
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    with pytest.raises(cli.MissingExtra, match="no executor is registered"):  # past the NIXL check
        cli._executor()
    present.discard("nixl_cu13")
    with pytest.raises(cli.MissingExtra, match="needs nixl"):
        cli._executor()


@pytest.mark.parametrize("flag", ["--max-work", "--max-steps", "--budget-mb"])
def test_every_budget_limit_has_a_flag_and_the_fix_names_it(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """Issue 20 (3): the fix of a budget refusal said --budget-mb for every limit; each limit now
    names its own flag, and rerunning with the suggested value plans."""
    import re

    value = {"--max-work": "5", "--max-steps": "3", "--budget-mb": "1"}[flag]
    argv = ["plan", "--tokens", "4096", "--layers", "1"]
    rc, _, err = _run(capsys, *argv, flag, value)
    assert rc == 2 and "budget" in err
    for _ in range(4):  # the simulation and the plan are checked in turn: follow each fix
        found = re.search(rf"{flag} (\d+)", err.split("fix:", 1)[1])
        assert found, err
        value = found.group(1)
        rc, _, err = _run(capsys, *argv, flag, value)
        if rc == 0:
            break
    assert rc == 0, err
