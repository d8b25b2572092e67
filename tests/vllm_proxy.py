"""A minimal prefill/decode proxy for two ``vllm serve`` instances, standard library only.

It does what vLLM's P/D proxies do for a pull connector (vLLM's NixlConnector, and
``KvgeomConnector`` with the same fields), for ``POST /v1/completions``:

1. the client's request goes to P as a one-token, non-streaming completion whose
   ``kv_transfer_params`` ask P to keep the prompt's KV for a remote decode
   (``do_remote_decode: true``; the other fields present and null, as vLLM's proxies send them);
2. P answers with ``kv_transfer_params`` naming its engine, request, blocks and side channel
   (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
   ``remote_host``, ``remote_port``, ``tp_size``, ``remote_num_tokens``);
3. the client's request goes to D unchanged except for those params; D pulls the KV from P,
   decodes, and its answer is the client's answer.

Both legs carry the same ``X-Request-Id`` header. Use :func:`disaggregate` in code, or run it::

    python tests/vllm_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

(no streaming, one P and one D: a test and README example, not a production router).
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["PREFILL_PARAMS", "prefill_body", "decode_body", "disaggregate", "ProxyServer"]

#: The ``kv_transfer_params`` of the request to P.
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _post(url: str, body: dict[str, Any], request_id: str, timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return dict(json.load(resp))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for P: one token, no streaming, :data:`PREFILL_PARAMS`."""
    out = copy.deepcopy(body)
    out.pop("stream_options", None)
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], p_answer: dict[str, Any]) -> dict[str, Any]:
    """The request for D: the client's, with the ``kv_transfer_params`` P returned (raises if none)."""
    params = p_answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise RuntimeError(f"P returned no kv_transfer_params (is its --kv-transfer-config set?): {p_answer}")
    return {**copy.deepcopy(body), "kv_transfer_params": params}


def disaggregate(prefill_url: str, decode_url: str, body: dict[str, Any], path: str = "/v1/completions",
                 timeout_s: float = 300) -> tuple[dict[str, Any], dict[str, Any]]:
    """One client request through P then D; returns (P's answer, D's answer)."""
    request_id = uuid.uuid4().hex
    p_answer = _post(prefill_url + path, prefill_body(body), request_id, timeout_s)
    d_answer = _post(decode_url + path, decode_body(body, p_answer), request_id, timeout_s)
    return p_answer, d_answer


class ProxyServer:
    """:func:`disaggregate` behind ``POST /v1/completions`` on ``host:port`` (0: a free port), in a thread."""

    def __init__(self, prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 0) -> None:
        urls = (prefill_url, decode_url)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self.path != "/v1/completions":
                    self._reply(404, {"error": f"only POST /v1/completions is proxied, not {self.path}"})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                    if body.get("stream"):
                        raise ValueError("streaming is not proxied here")
                    _, answer = disaggregate(*urls, body)
                except Exception as e:  # the client sees why; the proxy lives on
                    self._reply(502, {"error": f"{type(e).__name__}: {e}"})
                    return
                self._reply(200, answer)

            def _reply(self, code: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return None

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> ProxyServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8100")
    ap.add_argument("--decode", required=True, help="D's base URL, e.g. http://127.0.0.1:8200")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    proxy = ProxyServer(args.prefill, args.decode, args.host, args.port)
    print(f"proxying {proxy.url}/v1/completions -> P {args.prefill}, D {args.decode}", flush=True)
    proxy.httpd.serve_forever()


if __name__ == "__main__":
    main()
