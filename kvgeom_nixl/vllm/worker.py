"""The worker side of ``KvgeomConnector`` (docs/design.md §15.3): vLLM's objects in, the executor's calls out.

One instance per vLLM worker rank. ``register_kv_caches`` reads the rank's geometry from the layer
tensors vLLM registers (:mod:`kvgeom_nixl.vllm.caches`: the KV-cache config's groups, each layer's
backend and kernel, no stride arithmetic) and starts the rank's
:class:`~kvgeom_nixl.vllm.executor.ConnectorExecutor` (endpoints, side channel on
``KVGEOM_SIDE_CHANNEL_PORT + rank``, its progress and jobs threads). Per engine step:

* ``start_load_kv(metadata)``: hands the step's pulls, releases and pending sends to the executor
  (queues only: the handshake, the planning and the posting happen on the executor's threads).
* ``get_transfer_results(finished_req_ids)``: what ended since the last step: P's freed sends
  (``finished_sending``), D's settled pulls (``finished_recving``). A failed pull is also in
  ``finished_recving``, and its D blocks go to ``get_block_ids_with_load_errors`` (one KV-cache
  group: vLLM recomputes just those blocks) or, with several groups (where vLLM refuses block-level
  errors), the request is in ``failed_recving`` (vLLM recomputes it from the start). vLLM then
  recomputes with ``kv_load_failure_policy="recompute"``; its default ``"fail"`` ends the request.
"""

from __future__ import annotations

import os
from typing import Any

from kvgeom import EngineGeometry
from kvgeom_nixl.errors import ExecutorError
from kvgeom_nixl.staging import staging_bytes_for

from .caches import CacheGroup, geometry_from_kv_caches
from .executor import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_PULL_TIMEOUT_S,
    PACKED_SETUP_S,
    ConnectorExecutor,
    PullJob,
    ReleaseJob,
)
from .scheduler import DEFAULT_PORT, KvgeomMetadataFields, Release

__all__ = ["KvgeomWorker", "cache_groups", "config_model"]


def cache_groups(vllm_config: Any, kv_cache_config: Any) -> list[CacheGroup]:
    """The KV-cache groups of ``kv_cache_config`` as :class:`CacheGroup` values: each group's
    layers, logical block, window, the model's total KV heads, each layer's backend and kernel
    (read from vLLM's attention layers in the static forward context); a mamba group's state
    tensors (``MambaSpec.shapes`` and ``dtypes``), its conv state layout and cache mode."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    layers = vllm_config.compilation_config.static_forward_context
    total_heads = int(vllm_config.model_config.get_total_num_kv_heads())
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        names = tuple(str(n) for n in g.layer_names)
        if isinstance(spec, MambaSpec):
            out.append(CacheGroup(f"g{i}", "mamba", names, int(spec.block_size), total_heads, None, {}, {},
                                  tuple(tuple(int(n) for n in shape) for shape in spec.shapes), tuple(spec.dtypes),
                                  str(get_conv_state_layout()), str(spec.mamba_cache_mode) == "none"))
            continue
        if isinstance(spec, SlidingWindowSpec):
            kind, window = "sliding", int(spec.sliding_window)
        elif type(spec).__name__ == "MLAAttentionSpec":
            kind, window = "mla", None
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ == "FullAttentionSpec":
            kind, window = "full", None  # (a sliding layer in a full group keeps every block: moved whole)
        else:
            raise ExecutorError(f"kv_cache_groups[{i}].kv_cache_spec", f"{type(spec).__name__} groups are not "
                                "moved by this connector yet", actual=type(spec).__name__,
                                expected=["FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec"],
                                fix="use vLLM's NixlConnector for other group kinds")
        backend = {n: str(layers[n].attn_backend.get_name()) for n in names if n in layers}
        isa = {n: getattr(layers[n], "isa", None) for n in names if n in layers}
        out.append(CacheGroup(f"g{i}", kind, names, int(spec.block_size), total_heads, window, backend, isa))
    return out


def config_model(kv_cache_config: Any, groups: list[CacheGroup], tp: int) -> Any:
    """kvgeom's reading of vLLM's KV-cache config (:func:`kvgeom.building.engine_from_vllm_config`:
    a mamba group's sections, their channels and TP sharding), for an engine with a mamba group;
    ``None`` otherwise (attention groups are read from the tensors alone)."""
    if not any(g.kind == "mamba" for g in groups):
        return None
    from kvgeom.building import engine_from_vllm_config

    attention = [g for g in groups if g.kind != "mamba"]
    isa = next((v for g in attention for v in g.isa.values() if v), "vec")
    conv = next(g.conv_layout for g in groups if g.kind == "mamba")
    return engine_from_vllm_config(kv_cache_config, tp=tp, attention_backend="CPU_ATTN", cpu_isa=str(isa),
                                   conv_state_layout=conv, total_num_kv_heads=attention[0].total_kv_heads if attention
                                   else None, group_names=[g.name for g in groups], name="config").model


class KvgeomWorker:
    """Worker-side state of one vLLM worker rank."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.logger import init_logger

        self.log = init_logger("vllm.kvgeom_connector")  # vLLM's handlers (kvgeom_nixl's logger has none here)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        kvt = vllm_config.kv_transfer_config
        self.extra = dict(kvt.kv_connector_extra_config or {})
        self.producer, self.consumer = bool(kvt.is_kv_producer), bool(kvt.is_kv_consumer)
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.rank = int(get_tensor_model_parallel_rank())
        self.host = os.environ.get("KVGEOM_SIDE_CHANNEL_HOST", "127.0.0.1")
        self.port = int(self.extra.get("side_channel_port", os.environ.get("KVGEOM_SIDE_CHANNEL_PORT", DEFAULT_PORT)))
        self.executor: ConnectorExecutor | None = None
        self.groups = 1
        self._invalid: set[int] = set()

    # ---- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        groups = cache_groups(self.vllm_config, self.kv_cache_config)
        self.groups = len(groups)
        geo, layers = geometry_from_kv_caches(kv_caches, groups, tp=self.tp, name=self.engine_id,
                                              model=config_model(self.kv_cache_config, groups, self.tp))
        staging = _staging_bytes(self.extra, geo, self.rank, int(self.vllm_config.model_config.max_model_len))
        self.executor = ConnectorExecutor(
            geo, self.rank, self.tp, layers, engine_id=self.engine_id, producer=self.producer, consumer=self.consumer,
            host=self.host, port=self.port + self.rank, staging_bytes=staging,
            pull_timeout_s=float(self.extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S)),
            handshake_timeout_s=float(self.extra.get("handshake_timeout_s", DEFAULT_HANDSHAKE_TIMEOUT_S)),
            log=self.log, eager=_flag(self.extra, "eager_pull", False), packed_setup_s=_packed_setup_s(self.extra))
        self.log.info("kvgeom connector rank %d: %s, side channel %s:%d, staging %d B", self.rank, geo.summary(),
                      self.host, self.port + self.rank, staging)

    def _executor(self) -> ConnectorExecutor:
        if self.executor is None:
            raise ExecutorError("register_kv_caches", "the connector was used before vLLM registered its KV caches")
        return self.executor

    # ---- per step --------------------------------------------------------------------------
    def start_load_kv(self, meta: KvgeomMetadataFields) -> None:
        ex = self._executor()
        for rid, lease_s in meta.sends.items():
            ex.send(rid, lease_s)
        for rel in meta.releases:
            ex.release(_release_job(rel))
        for pull in meta.pulls:
            ex.pull(PullJob(pull.request_id, pull.release.remote_request_id, pull.remote_engine_id,
                            pull.computed_tokens, pull.prefix_hit_tokens, pull.remote_blocks, pull.local_blocks,
                            _release_job(pull.release), pull.recomputed_tokens))

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving); the invalid blocks of the same
        failures wait for :meth:`get_block_ids_with_load_errors`, asked right after in the same step."""
        if self.executor is None:
            return set(), set(), set()
        r = self.executor.take()
        failed: set[str] = set()
        for rid, bad in r.failed.items():
            if self.groups == 1 and bad:  # vLLM recomputes from the first invalid block
                self._invalid.update(b for ids in bad.values() for b in ids)
            else:  # several groups (block ids are per group), or nothing listed: recomputed whole
                failed.add(rid)
        return r.finished_sending, r.finished_recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None


def _release_job(rel: Release) -> ReleaseJob:
    return ReleaseJob(rel.remote_request_id, rel.remote_host, rel.remote_port, rel.remote_tp)



def _staging_bytes(extra: dict[str, Any], geo: EngineGeometry, rank: int, max_model_len: int) -> int:
    """The rank's staging slot (``kv_connector_extra_config.staging_bytes``): absent or ``"auto"``,
    :func:`~kvgeom_nixl.staging.staging_bytes_for` of ``max_model_len`` tokens (a request packs in one
    chunk up to 64 MiB); an int, that many bytes; 0, no staging ring (auto then never packs)."""
    value = extra.get("staging_bytes", "auto")
    if value == "auto":
        return staging_bytes_for(geo, rank, max_model_len)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 40:
        raise ExecutorError("kv_connector_extra_config.staging_bytes", "must be \"auto\" or a byte count",
                            actual=value, expected='"auto" (default), 0 (no packed pulls) or bytes per slot <= 2**40',
                            fix='write "staging_bytes": "auto", or a JSON integer such as 16777216')
    return value


def _packed_setup_s(extra: dict[str, Any]) -> float:
    """``kv_connector_extra_config.packed_setup_ms``: what auto adds to a packed pull's cost, in
    milliseconds (default :data:`~kvgeom_nixl.vllm.pulls.PACKED_SETUP_S`, measured here; 0 packs
    wherever kvgeom's cost model alone says packing is cheaper)."""
    value = extra.get("packed_setup_ms", PACKED_SETUP_S * 1e3)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 60_000:
        raise ExecutorError("kv_connector_extra_config.packed_setup_ms", "must be a number of milliseconds",
                            actual=value, expected=f"0 <= ms <= 60000 (default {PACKED_SETUP_S * 1e3:g})",
                            fix='write "packed_setup_ms": 12 (a JSON number), or 0 to weigh packing by kvgeom\'s '
                                'cost model alone')
    return float(value) / 1e3


def _flag(extra: dict[str, Any], name: str, default: bool) -> bool:
    """A yes/no key of ``kv_connector_extra_config`` (JSON true/false only: "false" as a string is refused)."""
    value = extra.get(name, default)
    if not isinstance(value, bool):
        raise ExecutorError(f"kv_connector_extra_config.{name}", "must be true or false", actual=value,
                            expected=f"true or false (default {str(default).lower()})",
                            fix=f'write "{name}": {str(default).lower()} (a JSON boolean, not a string)')
    return value
