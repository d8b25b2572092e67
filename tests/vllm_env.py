"""Real vLLM for the tests: the venv made by ``scripts/vllm-venv`` and a way to run code in it.

vLLM is never imported into the test process (it is not in the ``dev`` extra, and ``import kvgeom``
stays pure): tests run a script under the venv's interpreter, which sees this checkout first on
``PYTHONPATH``, and read back what it prints as JSON on its last line.

The venv is made on first use (about 2-3 minutes from a fresh clone; reused after that, see the
script). A failure to make it fails the test that asked for it: a vLLM test that skips in CI is a
test that does not exist.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "vllm_python", "vllm_env", "run_in_vllm"]


@functools.lru_cache(maxsize=1)
def vllm_python() -> str:
    """Path of the vLLM venv's python, making the venv if needed (raises on failure)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "vllm-venv")], capture_output=True, text=True,
                          timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/vllm-venv failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment for a vLLM subprocess: this checkout first on PYTHONPATH, NIXL quiet on loopback."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def run_in_vllm(script: str, *args: str, timeout_s: float = 900, env: dict[str, str] | None = None,
                cwd: str | os.PathLike[str] | None = None) -> Any:
    """Run ``script`` (a path or ``-c`` code) under the vLLM venv; return the JSON on its last stdout line."""
    cmd = [vllm_python(), *(["-c", script] if "\n" in script else [script]), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env=env or vllm_env(), cwd=cwd or ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1:3]} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                           f"stderr:\n{proc.stderr[-6000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"{cmd[1:3]} printed nothing\nstderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":  # pragma: no cover - manual check
    print(vllm_python(), file=sys.stderr)
