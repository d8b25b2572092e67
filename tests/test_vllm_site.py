"""The patches ``tests/vllm_e2e_site`` applies to every vLLM process of the end-to-end tests.

The TP1 P -> TP2 D cells pass only while a TP2 D's workers sleep between turns of their spin
instead of calling ``sched_yield()`` (on this VM's kernel the yield-spin starves P; the site's
docstring and the README have the measurements). A vLLM upgrade that renames what the site patches
would silently bring the stalls back, so the patches are checked here in vLLM's venv, with the
patch turned off (``KVGEOM_E2E_YIELD_SLEEP_S=0``) as the control that leaves vLLM's own function.
"""

from __future__ import annotations

import os

from vllm_env import run_in_vllm, vllm_env
from vllm_pd import SITE

SCRIPT = """
import json
from vllm.distributed import utils
from vllm.distributed.device_communicators import shm_broadcast as m
init = m.SpinCondition.__init__
print(json.dumps({"yield": m.sched_yield.__name__, "vllm_yield": m.sched_yield is utils.sched_yield,
                  "busy_loop_s": init.__defaults__[-1]}))
"""


def _site_env(**extra: str) -> dict[str, str]:
    env = vllm_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), env["PYTHONPATH"]])
    return env


def test_tp_workers_sleep_instead_of_yield_spinning() -> None:
    got = run_in_vllm(SCRIPT, timeout_s=300, env=_site_env())
    assert got == {"yield": "_sleep_a_little", "vllm_yield": False, "busy_loop_s": 0.01}, got
    control = run_in_vllm(SCRIPT, timeout_s=300, env=_site_env(KVGEOM_E2E_YIELD_SLEEP_S="0"))
    assert control["vllm_yield"] and control["yield"] == "sched_yield", control
