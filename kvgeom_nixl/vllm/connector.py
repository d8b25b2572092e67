"""``KvgeomConnector``: vLLM's ``KVConnectorBase_V1`` on kvgeom (docs/design.md §15).

    LLM(..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvgeomConnector", kv_connector_module_path="kvgeom_nixl.vllm",
        kv_role="kv_both", kv_buffer_device="cpu"))

vLLM builds the connector twice: once in the scheduler process (``KVConnectorRole.SCHEDULER``,
:class:`~kvgeom_nixl.vllm.scheduler.KvgeomScheduler`) and once per worker rank
(``KVConnectorRole.WORKER``, :class:`~kvgeom_nixl.vllm.worker.KvgeomWorker`); this facade forwards
each call of the interface to the side that implements it. The scheduler's decisions reach the
workers in :class:`KvgeomConnectorMetadata`, once per step. Layer-wise loading and saving are not
used: D pulls whole requests before they are scheduled (asynchronous loads), and P's KV is read
in place, so ``wait_for_layer_load``, ``save_kv_layer`` and ``wait_for_save`` do nothing.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvgeom_nixl.errors import ExecutorError

from .scheduler import KvgeomMetadataFields, KvgeomScheduler
from .worker import KvgeomWorker

__all__ = ["KvgeomConnector", "KvgeomConnectorMetadata"]


class KvgeomConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One scheduler step's pulls, releases and pending sends, for every worker rank."""

    def __init__(self, fields: KvgeomMetadataFields) -> None:
        self.fields = fields


class KvgeomConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector moving KV with kvgeom's plans over NIXL (pull: D reads P's pages).

    ``SupportsHMA``: with several KV-cache groups (vLLM's hybrid allocator) P's blocks are handed
    over per group (``request_finished_all_groups``), and failed loads are reported per request."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._scheduler: KvgeomScheduler | None = None
        self._worker: KvgeomWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvgeomScheduler(vllm_config, engine_id, kv_cache_config)
        else:
            self._worker = KvgeomWorker(vllm_config, engine_id, kv_cache_config)

    def _sched(self) -> KvgeomScheduler:
        if self._scheduler is None:
            raise ExecutorError("role", "a scheduler-side call on a worker connector")
        return self._scheduler

    def _work(self) -> KvgeomWorker:
        if self._worker is None:
            raise ExecutorError("role", "a worker-side call on the scheduler connector")
        return self._worker

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvgeomConnectorMetadata):
            raise ExecutorError("connector_metadata", f"expected KvgeomConnectorMetadata, got {type(meta).__name__}")
        self._work().start_load_kv(meta.fields)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._work().get_transfer_results(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self._sched().loaded_group_ids(self._kv_cache_config)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvgeomConnectorMetadata:
        return KvgeomConnectorMetadata(self._sched().build_connector_meta())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)
