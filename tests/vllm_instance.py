"""One vLLM instance serving requests from stdin, for the end-to-end tests (runs under the vLLM venv).

    <venv>/bin/python tests/vllm_instance.py --model DIR --block-size 32 --tp 1 --connector nixl

Starts an offline ``vllm.LLM`` once (float32, eager, greedy, token-id prompts, no tokenizer), prints
``@@kvgeom {"ready": ...}`` and then answers one JSON line per request read from stdin with one
``@@kvgeom <json>`` line on stdout (vLLM's own logging shares stdout; the marker tells them apart):

* ``{"op": "generate", "prompt": [ids], "max_tokens": n, "kv_transfer_params": {...} | null}`` ->
  ``{"tokens", "logprobs" (per step: {token id: logprob}), "finish_reason", "kv_transfer_params",
  "num_cached_tokens"}``. A P request is ``max_tokens=1`` with ``{"do_remote_decode": true}``; a D
  request passes the params P returned.
* ``{"op": "stats"}`` -> ``{"free_blocks", "total_blocks", "requests", "connector"}``: the scheduler's
  free KV blocks (of ``total_blocks``), the requests it still tracks (finished ones whose blocks
  wait for the connector included), and the kvgeom connector's counters
  (``ConnectorExecutor.counters()``; null for other connectors). TP1 only (the worker is in this process).
* ``{"op": "abort", "prompt", "max_tokens", "kv_transfer_params", "steps": k}`` -> ``{"aborted": true}``:
  the request is added, the engine stepped ``k`` times, then the request aborted (a client gone).
* ``{"op": "fault", "kind": "die_on_read"}`` -> ``{"armed": ...}``: from now on, this process
  SIGKILLs itself as soon as one of its connector's holds hears from a D rank: the ``read`` of an
  eager pull (D's READ is done, P's confirmation never comes) or the ``req`` of one that asks first
  (P dies before granting). P killed mid-transfer. TP1 only.
* ``{"op": "quit"}`` -> exits.

One process serves many requests so that a test pays vLLM's start-up (20-50 s here) once per
instance, not once per prompt. ``--connector`` is ``none`` (monolithic), ``nixl`` (vLLM's own
NixlConnector) or ``kvgeom`` (``kvgeom_nixl.vllm.KvgeomConnector``); both sides use ``kv_both``
with CPU buffers. vLLM is imported only here, never in the pytest process.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
import traceback
from typing import Any

MARK = "@@kvgeom "


def emit(obj: Any) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def transfer_config(connector: str, extra: dict[str, Any], policy: str = "fail") -> Any:
    from vllm.config import KVTransferConfig

    if connector == "none":
        return None
    if connector == "nixl":
        # P frees a pending send after the lease; D may start long after P here, so raise it.
        return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu",
                                kv_connector_extra_config={"kv_lease_duration": 120, **extra},
                                kv_load_failure_policy=policy)
    if connector == "kvgeom":
        return KVTransferConfig(kv_connector="KvgeomConnector", kv_connector_module_path="kvgeom_nixl.vllm",
                                kv_role="kv_both", kv_buffer_device="cpu",
                                kv_connector_extra_config={"kv_lease_duration": 180, **extra},
                                kv_load_failure_policy=policy)
    raise SystemExit(f"unknown --connector {connector!r} (none, nixl, kvgeom)")


def result(out: Any) -> dict[str, Any]:
    comp = out.outputs[0]
    steps = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in (comp.logprobs or [])]
    return {"tokens": [int(t) for t in comp.token_ids], "logprobs": steps, "finish_reason": comp.finish_reason,
            "kv_transfer_params": out.kv_transfer_params, "num_cached_tokens": out.num_cached_tokens}


IDLE_STEP_S = 0.01  # while it waits for a request, the instance steps an engine that holds finished requests


def generate(llm: Any, rid: str, prompt: list[int], sp: Any) -> Any:
    """One request through the engine, returned as soon as it is finished.

    ``LLM.generate`` would return only once the engine is idle, which for P is after D has
    pulled the request's blocks (P keeps them until then), and D starts after P returns here.
    """
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
    while True:
        outs = engine.step()
        for out in outs:
            if out.request_id == rid and out.finished:
                return out
        if not outs:  # (D waiting for its KV: do not spin a core the transfer needs)
            time.sleep(0.001)


def engine_core(llm: Any) -> Any:
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("stats and faults need the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core


def stats(llm: Any) -> dict[str, Any]:
    """The scheduler's free blocks and tracked requests, and the kvgeom connector's counters."""
    from kvgeom_nixl.vllm.executor import local_executor

    sched = engine_core(llm).scheduler
    pool = sched.kv_cache_manager.block_pool
    kvt = llm.llm_engine.vllm_config.kv_transfer_config
    ex = local_executor(str(kvt.engine_id)) if kvt is not None else None
    return {"free_blocks": int(pool.get_num_free_blocks()), "total_blocks": int(pool.num_gpu_blocks),
            "requests": len(sched.requests), "connector": ex.counters() if ex is not None else None}


def abort(llm: Any, rid: str, prompt: list[int], sp: Any, steps: int) -> None:
    """Add a request, step ``steps`` times, abort it (the engine then frees it as a client abort)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
    for _ in range(steps):
        engine.step()
    engine.abort_request([rid])


def arm(kind: str) -> None:
    """A fault for the fault tests (module docstring)."""
    import signal

    from kvgeom_nixl.transfer import Transfer

    if kind != "die_on_read":
        raise ValueError(f"unknown fault {kind!r} (die_on_read)")
    original = Transfer._on

    def on(self: Any, m: Any) -> None:
        if self.kind in ("hold", "serve_pull") and m.kind in ("read", "req"):
            os.kill(os.getpid(), signal.SIGKILL)  # before P answers (held, or grant)
        original(self, m)

    Transfer._on = on  # type: ignore[method-assign]


def holding(llm: Any) -> bool:
    """Whether the in-process engine still has requests (here: finished ones whose blocks wait for D)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # the in-process EngineCore
    return bool(core is not None and core.scheduler.has_requests())


def lines(llm: Any) -> Any:
    """stdin's lines; between them, step the engine every ``IDLE_STEP_S`` while it holds requests.

    The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): nothing else steps
    it, and a P engine must step to hand its connector the requests D will pull and to free them
    afterwards (``vllm serve``'s engine-core process busy-loops for that instead, ~1.5 cores here).
    """
    buf = b""
    while True:
        while b"\n" not in buf:
            ready, _, _ = select.select([0], [], [], IDLE_STEP_S)
            if ready:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return
                buf += chunk
            elif holding(llm):
                llm.llm_engine.step()
        line, buf = buf.split(b"\n", 1)
        yield line.decode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--connector", default="none")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache per worker (MiB)")
    ap.add_argument("--failure-policy", default="fail", help="kv_load_failure_policy: fail (vLLM's default) or "
                    "recompute (a failed load is recomputed)")
    ap.add_argument("--dtype", default="float32", help="float32, or bfloat16 (CPU GDN needs it)")
    ap.add_argument("--attention-backend", default="", help="vLLM's attention backend ('' lets vLLM choose; "
                    "CPU_MLA for a float32 MLA model, where vLLM would pick AMX_MLA)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="a mamba hybrid without prefix caching: "
                    "mamba_cache_mode 'none', one state block per request")
    args = ap.parse_args()
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype, attention_backend=args.attention_backend or None,
              block_size=args.block_size, tensor_parallel_size=args.tp, seed=args.seed,
              max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
              kv_cache_memory_bytes=args.kv_cache_mb << 20,
              kv_transfer_config=transfer_config(args.connector, json.loads(args.extra), args.failure_policy))
    emit({"ready": True, "block_size": args.block_size, "tp": args.tp, "connector": args.connector})
    count = 0
    for line in lines(llm):
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            if msg["op"] == "quit":
                break
            if msg["op"] == "stats":
                emit(stats(llm))
                continue
            if msg["op"] == "fault":
                arm(str(msg["kind"]))
                emit({"armed": msg["kind"]})
                continue
            params = msg.get("kv_transfer_params")
            sp = SamplingParams(max_tokens=int(msg["max_tokens"]), temperature=0.0, logprobs=5, ignore_eos=True,
                                detokenize=False,
                                extra_args={"kv_transfer_params": params} if params is not None else None)
            count += 1
            if msg["op"] == "abort":
                abort(llm, f"r{count}", msg["prompt"], sp, int(msg.get("steps", 0)))
                emit({"aborted": True})
                continue
            emit(result(generate(llm, f"r{count}", msg["prompt"], sp)))
        except Exception:  # reported to the test, which fails with the traceback; the instance lives on
            emit({"error": traceback.format_exc()})
    emit({"bye": True})


if __name__ == "__main__":
    main()
