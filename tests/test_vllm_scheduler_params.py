"""kv_transfer_params are a client's input (vLLM reads them from the request body): the connector's
scheduler side (kvgeom_nixl/vllm/scheduler.py) checks every field before it uses one, and a request
whose params do not pass computes its prompt itself, with a warning naming the field; nothing is
raised into vLLM's scheduler. The good params are P's own (``request_finished``'s return), and the
pull they make is checked field by field against them (control: the same calls pass with them)."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from kvgeom_nixl.vllm.scheduler import MAX_REMOTE_IDS, KvgeomScheduler, Pull, Release


def _scheduler() -> KvgeomScheduler:
    config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}),
                                   parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
    return KvgeomScheduler(config, "D-engine")


def _good() -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[7, 8, 9, 10]],
            "remote_engine_id": "P-engine", "remote_request_id": "cmpl-1", "remote_host": "127.0.0.1",
            "remote_port": 5700, "tp_size": 1, "remote_num_tokens": 100}


class _Blocks:
    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[3, 4, 5, 6]]


def _run(params: dict[str, Any]) -> tuple[tuple[int, bool], KvgeomScheduler]:
    s = _scheduler()
    request = types.SimpleNamespace(request_id="d-1", kv_transfer_params=params, num_prompt_tokens=100,
                                    num_tokens=100)
    got = s.get_num_new_matched_tokens(request, 0)
    s.update_state_after_alloc(request, _Blocks(), got[0])
    return got, s


def test_good_params_make_the_pull_they_name() -> None:
    got, s = _run(_good())
    assert got == (100, True)
    meta = s.build_connector_meta()
    assert meta.pulls == [Pull("d-1", ((3, 4, 5, 6),), ((7, 8, 9, 10),), 100, 0, "P-engine",
                               Release("cmpl-1", "127.0.0.1", 5700, 1), 1)]
    assert meta.releases == []
    flat = {**_good(), "remote_block_ids": [7, 8, 9, 10], "tp_size": None, "remote_num_tokens": None}
    got, s = _run(flat)  # (one flat list; no tp_size; no token count: the prompt's)
    assert got == (100, True) and s.build_connector_meta().pulls[0].remote_blocks == ((7, 8, 9, 10),)


BAD: list[tuple[str, Any, bool]] = [  # (field, value, P can still be released)
    ("remote_block_ids", "7,8", True),
    ("remote_block_ids", [[7, "8"]], True),
    ("remote_block_ids", [[7, 8.0]], True),
    ("remote_block_ids", [[7, True]], True),
    ("remote_block_ids", [[7, -1]], True),
    ("remote_block_ids", [[7, 2**31]], True),
    ("remote_block_ids", [[[7]]], True),
    ("remote_block_ids", [[7]] * 300, True),
    ("remote_block_ids", [list(range(MAX_REMOTE_IDS // 2 + 1))] * 2, True),
    ("remote_block_ids", None, True),
    ("remote_engine_id", 5, True),
    ("remote_engine_id", "", True),
    ("remote_engine_id", "e" * 300, True),
    ("remote_num_tokens", "100", True),
    ("remote_num_tokens", -3, True),
    ("remote_num_tokens", 1.5, True),
    ("remote_port", "5700", False),
    ("remote_port", 0, False),
    ("remote_port", 70000, False),
    ("remote_port", True, False),
    ("tp_size", 0, False),
    ("tp_size", "2", False),
    ("tp_size", 10**9, False),
    ("remote_host", 127, False),
    ("remote_host", "h" * 300, False),
    ("remote_request_id", None, False),
    ("remote_request_id", 7, False),
    ("remote_request_id", "a|b", False),
    ("remote_request_id", "r" * 300, False),
]


@pytest.mark.parametrize("key, value, released", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_params_compute_the_prompt_and_name_the_field(key: str, value: Any, released: bool,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    params = {**_good(), key: value}
    with caplog.at_level(logging.WARNING, logger="kvgeom_nixl.vllm"):
        got, s = _run(params)
    assert got == (0, False) and params["do_remote_prefill"] is False
    meta = s.build_connector_meta()
    assert meta.pulls == []
    assert meta.releases == ([Release("cmpl-1", "127.0.0.1", 5700, 1)] if released else [])
    assert f"kv_transfer_params.{key}" in caplog.text, caplog.text


def test_an_abort_with_bad_params_releases_nothing_and_raises_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """D's request_finished before allocation (an abort) releases P: with a bad port it cannot,
    and says so (P's lease frees the blocks)."""
    s = _scheduler()
    request = types.SimpleNamespace(request_id="d-2", kv_transfer_params={**_good(), "remote_port": "x"})
    with caplog.at_level(logging.WARNING, logger="kvgeom_nixl.vllm"):
        assert s.request_finished(request, []) == (False, None)
    assert s.build_connector_meta().releases == [] and "kv_transfer_params.remote_port" in caplog.text
    request = types.SimpleNamespace(request_id="d-3", kv_transfer_params=_good())  # (control: released)
    assert s.request_finished(request, []) == (False, None)
    assert s.build_connector_meta().releases == [Release("cmpl-1", "127.0.0.1", 5700, 1)]
