"""Hostile documents and command lines (issue 11, docs/design.md §14).

The fuzzer mutates valid pair files (``benchmarks/hostile.py``'s file campaign: JSON leaves replaced
by extreme numbers and wrong types, keys deleted or added, nested ``"schema"`` markers, truncation,
byte flips, deep nesting, 5000-digit integers, 40 MiB documents) and loads each with
``load_pair_file``, then plans and simulates what it accepts: only ``SchemaError`` (a typed error)
may escape, a mutation that must be refused is refused, and each call stays under a generous
wall-clock and tracemalloc ceiling. The regressions are issue 11's defects 4, 6 and 8 on the command
line (in process, through ``kvgeom.tools.cli.main``).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis", reason="the fuzzers need the testing extra (hypothesis)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import hostile  # noqa: E402
from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, SchemaError, fresh_request  # noqa: E402
from kvgeom.tools import dump_pair_file, dumps, load_pair_file, loads, parse_json  # noqa: E402
from kvgeom.tools.cli import main  # noqa: E402

CEILING_S = 10.0
CEILING_MB = 200.0


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1))
def test_fuzz_pair_files(tmp_path_factory: Any, seed: int) -> None:
    data, must_reject, label = hostile.pair_file_case(random.Random(seed))
    out = hostile.run_pair_file(data, must_reject, label, folder=str(tmp_path_factory.getbasetemp()))
    assert out.kind in ("ok", "typed"), f"{label}: {out.kind}: {out.detail}"
    assert out.ms < CEILING_S * 1e3 and out.mb < CEILING_MB, out


def _pair_text() -> str:
    m = ModelSpec("m", [AttentionSpec("a", "full", 2, 2, 16)])
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=8, name="prefill")
    D = EngineGeometry.build(m, tp=2, kernel_block_tokens=8, num_blocks=8, name="decode")
    pair = Pair(P, D)
    return dump_pair_file(pair, fresh_request(pair, 20))


# ---- defect 6: malformed JSON escaped the typed errors ----------------------------------------------------

@pytest.mark.parametrize(("text", "words"), [
    ("[" * 100_000 + "]" * 100_000, "nested 100000 levels deep"),
    ("9" * 4301, "an integer of 4301 digits"),
    ('{"schema": 1, "type": "Region", "num_pages": ' + "1" * 5000 + ', "page_bytes": 1}', "5000 digits"),
    ('{"schema": 1, "type": "Region", "num_pages": NaN, "page_bytes": 1}', "NaN is not JSON"),
    ("x" * (5 << 20), "more than the 4,194,304"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_json_is_bounded_and_every_failure_is_a_schema_error(text: Any, words: str) -> None:
    with pytest.raises(SchemaError) as info:
        loads(text)
    assert words in str(info.value)


def test_nested_schema_markers_are_validated() -> None:
    doc = json.loads(_pair_text())
    doc["decode"]["regions"][0]["schema"] = 1  # a nested document may carry the version ...
    assert load_pair_from(doc)[0].decode.regions[0].num_pages == 8
    for bad in ("garbage", 2, None, [], True):  # ... and nothing else
        doc["decode"]["regions"][0]["schema"] = bad
        with pytest.raises(SchemaError) as info:
            load_pair_from(doc)
        assert info.value.path == "$.decode.regions[0].schema"
    engine = json.loads(dumps(load_pair_from(json.loads(_pair_text()))[0].decode))
    engine["model"]["schema"] = "1"
    with pytest.raises(SchemaError) as info:
        loads(json.dumps(engine))
    assert info.value.path == "$.model.schema"


def load_pair_from(doc: Any) -> Any:
    from kvgeom.tools import parse_pair_file

    return parse_pair_file(doc)


def test_parse_json_worked_limits() -> None:
    assert parse_json('{"a": [1, 2]}') == {"a": [1, 2]}
    assert parse_json("[" * 64 + "]" * 64) is not None
    with pytest.raises(SchemaError, match="65 levels"):
        parse_json("[" * 65 + "]" * 65)
    assert parse_json('"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["') .startswith("[")


# ---- defect 8 and 4 on the command line: bounded work, exit 2 before the work ------------------------------

@pytest.mark.parametrize("argv", [
    ["plan", "--tokens", "100000000"],
    ["plan", "--layers", "100000"],
    ["plan", "--preset", "llama3-70b-tp8-tp4", "--tokens", "4294967296"],
    ["transfer", "--tokens", "100000000"],
    ["plan", "--pair", "/dev/zero"],
    ["plan", "--pair", "/"],
    ["transfer", "--timeout", "nan"],
    ["transfer", "--timeout", "0"],
    ["transfer", "--timeout", "-1"],
    ["transfer", "--timeout", "inf"],
    ["plan", "--strategy", "packed", "--tokens", "16384", "--staging-bytes", "2048"],
    ["plan", "--strategy", "packed", "--staging-bytes", "-1"],
    ["plan", "--strategy", "packed", "--staging-bytes", "99999999999999999999"],
    ["transfer", "--strategy", "packed", "--tokens", "4096", "--budget-mb", "64"],
])
def test_hostile_flags_exit_2_at_once(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - t0 < CEILING_S  # the old code ran up to 70 s into MemoryError (exit 1)
    err = capsys.readouterr().err
    assert "error:" in err and "internal error" not in err and "Traceback" not in err


def test_budget_refusal_names_the_flag_that_raises_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tokens", "100000", "--budget-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert "PlanBudget" in err or "budget" in err and "--budget-mb" in err


@pytest.mark.parametrize("target", ["{dir}", "/dev/full", "/proc/version", "{dir}/missing/x.svg"])
def test_unwritable_drawing_targets_exit_2_before_planning(target: str, tmp_path: Path, monkeypatch: Any,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    if target.startswith("/") and not Path(target).exists():
        pytest.skip(f"{target} does not exist on this machine")
    import kvgeom.tools.cli as cli

    def no_planning(*a: Any, **k: Any) -> Any:
        raise AssertionError("planned before checking the output path")

    monkeypatch.setattr(cli, "plan_pair", no_planning)
    assert main(["plan", "--svg", target.format(dir=tmp_path)]) == 2
    assert "--svg: cannot write" in capsys.readouterr().err


def test_a_drawing_target_is_not_left_behind_when_the_command_fails(tmp_path: Path) -> None:
    target = tmp_path / "x.svg"
    assert main(["plan", "--svg", str(target), "--prefix", "17"]) == 2  # S not on a block boundary
    assert not target.exists()


def test_pair_file_json_output_and_oversized_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "pair.json"
    f.write_text(_pair_text())
    assert main(["plan", "--pair", str(f)]) == 0
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((4 << 20) + 1))
    capsys.readouterr()
    assert main(["plan", "--pair", str(big), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["error"]["path"] == str(big) and "longer than" in out["error"]["message"]
    with pytest.raises(SchemaError):
        load_pair_file(big)
