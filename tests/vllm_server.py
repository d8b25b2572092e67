"""A real ``vllm serve`` OpenAI-API server for the end-to-end tests, as a subprocess under the vLLM venv.

:class:`Server` starts ``vllm serve MODEL ...`` (through ``tests/vllm_serve.py``, vLLM's own CLI:
see there why) on a free 127.0.0.1 port, in its own session so that :meth:`Server.close` ends the
API server, the engine core and the worker vLLM spawned (and nothing else), and waits for
``GET /health``. A server that dies or does not come up raises with the tail of its log. Requests
are plain ``urllib`` (no HTTP client dependency): :func:`post_json`, :meth:`Server.metrics`.

The model runs as the offline tests run it (tests/vllm_instance.py): float32, eager, no tokenizer
(prompts are token ids, ``return_tokens_as_token_ids`` in requests), a fixed seed, a small KV cache
(``--kv-cache-memory-bytes``), unbound OpenMP threads, and the ``tests/vllm_e2e_site`` patches
(vLLM's worker waits on its step queue spinning 10 ms, not 1 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_env import ROOT, vllm_env, vllm_python
from vllm_pd import SITE

from kvgeom_nixl.testing import free_ports

__all__ = ["Server", "post_json", "get_text"]

SCRIPT = ROOT / "tests" / "vllm_serve.py"


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url`` and return the JSON answer (an HTTP error raises with its body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return dict(json.load(resp))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def get_text(url: str, timeout_s: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode())


class Server:
    """One ``vllm serve`` process tree; ``kv_transfer_config`` (a dict) is passed as ``--kv-transfer-config``.

    ``side_channel_port`` is kvgeom's, added to the config's ``kv_connector_extra_config``
    (``side_channel_port``; TP rank r listens on it + r).
    """

    def __init__(self, name: str, model: Path, *, block_size: int, log_dir: Path,
                 kv_transfer_config: dict[str, Any] | None = None, max_model_len: int = 1024,
                 kv_cache_mb: int = 64, seed: int = 0, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_ports(1)
        self.side_channel_port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = vllm_env(OMP_NUM_THREADS="1",
                            VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="INFO", **(env or {}))
        full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        full_env["PYTHONPATH"] = os.pathsep.join([str(SITE), full_env["PYTHONPATH"]])
        self.cmd = [vllm_python(), str(SCRIPT), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "--served-model-name", "tiny", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
                    "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--seed", str(seed),
                    "--kv-cache-memory-bytes", str(kv_cache_mb << 20), "--max-num-seqs", "4"]
        if kv_transfer_config is not None:  # (kvgeom's side-channel port in it: the command line says everything)
            extra = {**kv_transfer_config.get("kv_connector_extra_config", {}), "side_channel_port": self.side_channel_port}
            self.cmd += ["--kv-transfer-config", json.dumps({**kv_transfer_config, "kv_connector_extra_config": extra})]
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=ROOT, start_new_session=True)

    def tail(self, chars: int = 6000) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"{self.name} log tail ({self.log_path}):\n{text[-chars:]}"

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Until ``GET /health`` answers 200; raises with the log tail if the server exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited {self.proc.returncode} while starting\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name}: not ready in {timeout_s:.0f} s\n{self.tail()}")

    def completion(self, body: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        try:
            return post_json(self.url + "/v1/completions", {"model": "tiny", **body}, timeout_s)
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"{self.name}: {e}\n{self.tail()}") from None

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples of ``GET /metrics`` without HELP/TYPE lines: ``'name{labels}' -> value``."""
        out = {}
        for line in get_text(self.url + "/metrics").splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def close(self) -> None:
        """SIGTERM the server's session (API server, engine core, worker), then SIGKILL what is left."""
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)  # anyone left in the session (the engine core outlives its parent)?
                except ProcessLookupError:
                    break
                self.proc.poll()
                time.sleep(0.2)
        try:
            self.proc.wait(timeout=10)
        finally:
            self._log.close()
