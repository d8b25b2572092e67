"""Prefill/decode on real vLLM for the end-to-end tests: instances as subprocesses, and the comparison.

An :class:`Instance` is one ``tests/vllm_instance.py`` process under the vLLM venv (vLLM is never
imported here). It starts once and serves many requests over stdin/stdout JSON lines, because a
vLLM start-up costs 20-80 s on this machine. :func:`disaggregated` runs one request through P (one
token, ``do_remote_decode``) and then D (the params P returned); :func:`compare` holds D's output
against the monolithic run of the same prompt.

The comparison is on every generated token and on the top-k logprobs of every step: the same token
ids, each logprob within ``TOLERANCE`` of the monolithic one. float32 runs at different block sizes
are bit-identical here and TP1 vs TP2 differ by ~3e-6, so 1e-4 is loose enough for a right KV cache
and far tighter than what a wrong one gives (a different token or logprobs off by > 1e-2).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_env import ROOT, vllm_env, vllm_python

from kvgeom_nixl.testing import free_ports

__all__ = ["TOLERANCE", "Instance", "Comparison", "compare", "disaggregated"]

TOLERANCE = 1e-4
MARK = "@@kvgeom "
SCRIPT = ROOT / "tests" / "vllm_instance.py"
SITE = ROOT / "tests" / "vllm_e2e_site"  # sitecustomize.py: vLLM's workers spin 10 ms, not 1 s, sleeping 0.1 ms a turn


class Instance:
    """One vLLM process (``LLM`` offline engine) answering requests; stop it with :meth:`close`.

    ``connector`` is ``none``, ``nixl`` or ``kvgeom``. Each instance gets its own side-channel port
    (``VLLM_NIXL_SIDE_CHANNEL_PORT`` for vLLM's connector, ``KVGEOM_SIDE_CHANNEL_PORT`` for
    kvgeom's); ``env`` adds variables to its environment. The process runs in its own session so
    that :meth:`close` ends it with the engine and worker processes vLLM spawned, and nothing else.
    """

    def __init__(self, name: str, model: Path, *, block_size: int = 32, tp: int = 1, connector: str = "none",
                 extra: dict[str, Any] | None = None, log_dir: Path, kv_cache_mb: int = 64,
                 failure_policy: str = "fail", max_model_len: int = 2048, prefix_caching: bool = True,
                 env: dict[str, str] | None = None, dtype: str = "float32", attention_backend: str = "") -> None:
        self.name, self.block_size, self.tp, self.connector = name, block_size, tp, connector
        self.port = free_ports(2)  # the side channel of rank r (TP <= 2 here) listens on port + r
        extra_env = env
        env = vllm_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.port), KVGEOM_SIDE_CHANNEL_PORT=str(self.port),
                       VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", OMP_NUM_THREADS="1",
                       # the engine core in the instance's process (TP1: ~4x faster to start here than
                       # engine-core and worker processes; no busy loop starving the other instances)
                       VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.update(extra_env or {})
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-mb (vLLM reads it as whole GiB)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), env["PYTHONPATH"]])  # its workers spin 10 ms, not 1 s
        # vLLM's "auto" binding pins every instance's worker to the same core, where their OpenMP
        # threads spin: unbound TP1 workers with one OpenMP thread each share both cores instead.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else "nobind"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # closed in close()
        cmd = [vllm_python(), str(SCRIPT), "--model", str(model), "--block-size", str(block_size), "--tp", str(tp),
               "--connector", connector, "--extra", json.dumps(extra or {}), "--kv-cache-mb", str(kv_cache_mb),
               "--failure-policy", failure_policy, "--max-model-len", str(max_model_len)]
        cmd += ([] if prefix_caching else ["--no-prefix-caching"]) + ["--dtype", dtype, "--attention-backend",
                                                                       attention_backend]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env, cwd=ROOT, start_new_session=True)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path.with_suffix(".out"), "w") as out:  # vLLM logs to stdout
            for line in self.proc.stdout:
                if line.startswith(MARK):
                    self._replies.put(json.loads(line[len(MARK):]))
                else:
                    self._tail.append(line.rstrip())
                    out.write(line)
                    out.flush()
        self._replies.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            msg = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer in {timeout_s:.0f} s\n{self.diagnostics()}") from None
        if msg is None:
            raise RuntimeError(f"{self.name}: exited {self.proc.wait()}\n{self.diagnostics()}")
        if "error" in msg:
            raise RuntimeError(f"{self.name}: request failed:\n{msg['error']}\n{self.diagnostics()}")
        return msg

    def wait_ready(self, timeout_s: float = 600) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._next(timeout_s)
        return self.ready

    def generate(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
                 timeout_s: float = 300) -> dict[str, Any]:
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompt": prompt, "max_tokens": max_tokens,
                                          "kv_transfer_params": kv_transfer_params}) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def call(self, msg: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
        """Send one request line (``op`` and its fields, tests/vllm_instance.py) and return the answer."""
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def stats(self) -> dict[str, Any]:
        """The instance's free KV blocks, tracked requests and kvgeom connector counters."""
        return self.call({"op": "stats"})

    def diagnostics(self) -> str:
        self._log.flush()
        err = self.log_path.read_text()[-6000:] if self.log_path.exists() else ""
        return "stdout tail:\n" + "\n".join(self._tail) + f"\nstderr tail ({self.log_path}):\n{err}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self._replies.get(timeout=10)
            except (OSError, queue.Empty, ValueError):
                pass
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.proc.pid, sig)  # the session this instance leads: its engine and workers
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        self.proc.wait(timeout=30)
        self._log.close()


def disaggregated(p: Instance, d: Instance, prompt: list[int], max_tokens: int,
                  p_params: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """P prefills ``prompt`` (one token, ``do_remote_decode``); D decodes it from P's KV cache.

    Returns (P's output, D's output); ``p_params`` (a control handing D another request's params)
    skips P's prefill and gives D those params instead.
    """
    out_p = p.generate(prompt, 1, {"do_remote_decode": True}) if p_params is None else {}
    params = out_p["kv_transfer_params"] if p_params is None else p_params
    if not params:
        raise RuntimeError(f"{p.name} returned no kv_transfer_params: {out_p}\n{p.diagnostics()}")
    return out_p, d.generate(prompt, max_tokens, params)


@dataclass(frozen=True)
class Comparison:
    """D's output against the monolithic one: ``ok`` within ``TOLERANCE``; ``max_diff`` over shared steps."""

    ok: bool
    max_diff: float
    reason: str


def compare(ref: dict[str, Any], got: dict[str, Any], tol: float = TOLERANCE) -> Comparison:
    """Tokens equal, and at each step the same top-k token ids with logprobs within ``tol``."""
    if got.get("finish_reason") not in ("length", "stop"):
        return Comparison(False, float("inf"), f"finish_reason {got.get('finish_reason')!r}")
    worst, reason = 0.0, ""
    if got["tokens"] != ref["tokens"]:
        first = next((i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])) if a != b),
                     min(len(ref["tokens"]), len(got["tokens"])))
        reason = f"tokens differ from step {first}: {ref['tokens']} vs {got['tokens']}"
    if len(got["logprobs"]) != len(ref["logprobs"]):
        return Comparison(False, float("inf"), reason or f"{len(got['logprobs'])} logprob steps, {len(ref['logprobs'])} expected")
    for i, (a, b) in enumerate(zip(ref["logprobs"], got["logprobs"])):
        if set(a) != set(b):
            reason = reason or f"step {i}: top-k ids {sorted(a)} vs {sorted(b)}"
            worst = float("inf")
            continue
        worst = max(worst, max(abs(a[t] - b[t]) for t in a))
    if not reason and worst > tol:
        reason = f"logprobs differ by {worst:.3g} > {tol:g}"
    return Comparison(not reason, worst, reason or "equal")
