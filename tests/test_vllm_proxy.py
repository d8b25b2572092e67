"""tests/vllm_proxy.py without vLLM: what each leg of the P/D flow sends, against two fake servers.

The fakes record every request; P answers with ``kv_transfer_params`` (or without, to check the
proxy refuses to send D a request that would silently recompute). tests/test_vllm_serve.py runs
the same proxy against real ``vllm serve`` instances.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from vllm_proxy import PREFILL_PARAMS, ProxyServer

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[7, 3, 9]],
            "remote_engine_id": "p-engine", "remote_request_id": "cmpl-1-0", "remote_host": "127.0.0.1",
            "remote_port": 5700, "tp_size": 1, "remote_num_tokens": 70}


class Fake:
    """An HTTP server answering ``POST /v1/completions`` with ``answer`` and recording (headers, body)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer: dict[str, Any] = answer
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append((dict(self.headers), body))
                data = json.dumps(fake.answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture
def fakes() -> Iterator[tuple[Fake, Fake]]:
    p, d = Fake({"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS}), Fake({"choices": [{"text": "decoded"}]})
    yield p, d
    p.close()
    d.close()


def test_proxy_legs(fakes: tuple[Fake, Fake]) -> None:
    p, d = fakes
    proxy = ProxyServer(p.url, d.url).start()
    try:
        client = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "logprobs": 5, "stream_options": {"x": 1}}
        code, answer = post(proxy.url, client)
    finally:
        proxy.close()
    assert (code, answer) == (200, d.answer)  # the client gets D's answer
    ((p_headers, p_body),), ((d_headers, d_body),) = p.seen, d.seen
    assert p_body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1, "logprobs": 5, "stream": False,
                      "kv_transfer_params": PREFILL_PARAMS}
    assert PREFILL_PARAMS["do_remote_decode"] is True and PREFILL_PARAMS["remote_block_ids"] is None
    assert d_body == {**client, "kv_transfer_params": P_PARAMS}  # the client's request, with P's params
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"] != ""


def test_proxy_refuses_a_p_without_params(fakes: tuple[Fake, Fake]) -> None:
    p, d = fakes
    p.answer = {"choices": [{"text": "x"}], "kv_transfer_params": None}  # P without a KV connector
    proxy = ProxyServer(p.url, d.url).start()
    try:
        code, answer = post(proxy.url, {"model": "m", "prompt": [5], "max_tokens": 8})
    finally:
        proxy.close()
    assert code == 502 and "no kv_transfer_params" in answer["error"]
    assert d.seen == []  # D never got a request it would have computed by itself
