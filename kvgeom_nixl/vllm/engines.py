"""One side of a P/D pair as vLLM itself builds it on CPU, without a model forward pass.

For a tiny model (a ``config.json`` written here, no weights), :class:`VllmSide` goes through the
steps vLLM's engine core and CPU worker take (docs/design.md §10.6):

    EngineArgs(...).create_engine_config()            the VllmConfig (NixlConnector, kv_buffer_device cpu)
    Attention(...) per layer                          vLLM's own attention layers: the backend (CPU_ATTN)
                                                      is chosen by vLLM's selector, the specs by the layers
    resolve_kv_cache_layout, get_kv_cache_configs     the engine core's layout and KVCacheConfig
    allocate_kv_cache                                 the worker's allocation and per-layer views
    NixlConnector(vllm_config, WORKER, kv_cache_config).register_kv_caches(caches)   per TP rank
    NixlConnector(vllm_config, SCHEDULER, ...).set_xfer_handshake_metadata(...)       P's side channel

Tokens are written into the caches by the attention backend's own ``do_kv_cache_update`` (the
call vLLM's forward makes), so the in-page layout is vLLM's, not this module's belief about it.

TP ranks: every rank is a real NixlConnector worker with its own NIXL agent and cache, in this
one process; the only thing answered per rank is vLLM's TP-rank query, which the worker reads
once when it is built (its transfers use no collective).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .recording import RecordingAgent

__all__ = ["TinyModel", "VllmSide", "STALE_P", "STALE_D"]

STALE_P = -3.0  # what P's cache holds where P computed nothing (its last block past M)
STALE_D = -7.0  # what D's cache holds before the transfer (blocks of earlier requests)
KV_LORA_RANK, ROPE_DIM, NOPE_DIM = 512, 64, 32  # the MLA latent is 512 + 64 floats per token
# the hybrid's mamba2 mixer: 8 heads of 32 (intermediate 256 = hidden), 2 groups, state 16, conv kernel 4:
# conv state (DS) (256 + 2 * 2 * 16, 3) = (320, 3), ssm state (8, 32, 16), both float32
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, MAMBA_STATE, MAMBA_CONV = 8, 32, 2, 16, 4


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV-cache groups on a side: its name for kvgeom, kind and layers (vLLM's order)."""

    name: str
    kind: str  # "attn" (CPU_ATTN), "mla", "mamba"
    layers: tuple[str, ...]


@dataclass(frozen=True)
class TinyModel:
    """A Llama-shaped model small enough to move in milliseconds (float32, CPU_ATTN), or with
    ``mla=True`` a DeepSeek-V2-shaped one (CPU_MLA: one 576-float latent per token, 16-token blocks).

    ``kv_heads`` / ``head_dim`` are the cache's: for MLA one "head" of 512 + 64 floats.
    """

    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    hidden: int = 256
    mla: bool = False
    backend: str = ""  # "" lets vLLM choose (CPU_ATTN); MLA: "CPU_MLA" (float32, 16-token blocks) or "AMX_MLA"
    dtype: str = "float32"  # AMX_MLA runs bfloat16 only
    hybrid: str = ""  # "M*M*": a Nemotron-H-shaped model, mamba2 (M) and attention (*) layers

    @classmethod
    def deepseek(cls, amx: bool = False) -> TinyModel:
        return cls(layers=2, heads=8, kv_heads=1, head_dim=KV_LORA_RANK + ROPE_DIM, hidden=256, mla=True,
                   backend="AMX_MLA" if amx else "CPU_MLA", dtype="bfloat16" if amx else "float32")

    @classmethod
    def nemotron_h(cls) -> TinyModel:
        """Mamba2 + attention (layers 0, 2 mamba2; 1, 3 CPU_ATTN), float32: vLLM's NemotronHForCausalLM."""
        return cls(layers=2, hybrid="M*M*")

    @property
    def kind(self) -> str:
        return "nemotron-h" if self.hybrid else ("deepseek" if self.mla else "llama")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        if self.hybrid:
            (directory / "config.json").write_text(json.dumps({
                "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": self.hidden,
                "intermediate_size": 2 * self.hidden, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "hybrid_override_pattern": self.hybrid, "num_hidden_layers": len(self.hybrid), "vocab_size": 1024,
                "max_position_embeddings": 4096, "ssm_state_size": MAMBA_STATE, "mamba_num_heads": MAMBA_HEADS,
                "mamba_head_dim": MAMBA_HEAD_DIM, "n_groups": MAMBA_GROUPS, "conv_kernel": MAMBA_CONV, "expand": 1,
                "layer_norm_epsilon": 1e-5, "torch_dtype": self.dtype, "tie_word_embeddings": False,
                "mlp_hidden_act": "relu2", "chunk_size": 128, "use_conv_bias": True, "mamba_hidden_act": "silu",
                "mamba_ssm_cache_dtype": "float32"}))
            return directory
        if self.mla:
            (directory / "config.json").write_text(json.dumps({
                "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": self.hidden,
                "intermediate_size": 2 * self.hidden, "moe_intermediate_size": self.hidden,
                "num_attention_heads": self.heads, "num_key_value_heads": self.heads,
                "num_hidden_layers": self.layers, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None,
                "qk_nope_head_dim": NOPE_DIM, "qk_rope_head_dim": ROPE_DIM, "v_head_dim": NOPE_DIM,
                "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 2,
                "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                "torch_dtype": self.dtype, "tie_word_embeddings": False}))
            return directory
        (directory / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
            "intermediate_size": 2 * self.hidden, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "num_hidden_layers": self.layers,
            "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
            "tie_word_embeddings": False}))
        return directory

    def layer_name(self, i: int) -> str:
        return f"model.layers.{i}.self_attn.attn"


_DIST_READY = False


def _ensure_distributed(vllm_config: Any) -> None:
    """One world of one process (gloo), as vLLM's CPU worker initialises it for TP1."""
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        ensure_model_parallel_initialized(1, 1)
    _DIST_READY = True


@contextlib.contextmanager
def _as_rank(rank: int, tp: int) -> Iterator[None]:
    """vLLM's TP-rank queries answer ``rank`` of ``tp`` while a worker is built; NIXL agents record."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    saved = (base_worker.get_tensor_model_parallel_rank, base_worker.get_tensor_model_parallel_world_size,
             base_worker.NixlWrapper)
    base_worker.get_tensor_model_parallel_rank = lambda: rank
    base_worker.get_tensor_model_parallel_world_size = lambda: tp
    base_worker.NixlWrapper = RecordingAgent
    try:
        yield
    finally:
        (base_worker.get_tensor_model_parallel_rank, base_worker.get_tensor_model_parallel_world_size,
         base_worker.NixlWrapper) = saved


@contextlib.contextmanager
def _layout_env(layout: str) -> Iterator[None]:
    """``VLLM_KV_CACHE_LAYOUT=layout`` (the user's request; "" leaves vLLM's choice) while the side resolves it."""
    saved = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if layout:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = saved


class VllmSide:
    """One engine (P or D) of ``tp`` ranks at ``block_size`` tokens per block, built the vLLM way."""

    def __init__(self, engine_id: str, model: TinyModel, model_dir: Path, *, tp: int, block_size: int | None,
                 num_blocks: int, port: int, max_model_len: int = 512, kv_cache_layout: str = "") -> None:
        from vllm.config import KVTransferConfig, set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

        self.engine_id, self.model, self.tp, self.port = engine_id, model, tp, port
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        if model.hybrid:  # vLLM's NIXL mamba transfer needs the DS conv state layout (it asserts so)
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
        args = EngineArgs(
            model=str(model_dir), skip_tokenizer_init=True, dtype=model.dtype, block_size=block_size,
            enforce_eager=True, max_model_len=max_model_len, tensor_parallel_size=tp, num_gpu_blocks_override=num_blocks,
            attention_backend=model.backend or None,
            # a hybrid without prefix caching: mamba_cache_mode "none", one state block per request
            enable_prefix_caching=False if model.hybrid else None,
            kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu",
                                                engine_id=engine_id,
                                                kv_connector_extra_config={"kv_lease_duration": 900}))
        self.config = cfg = args.create_engine_config()
        _ensure_distributed(cfg)
        with set_current_vllm_config(cfg), _layout_env(kv_cache_layout):
            kv_heads = model.kv_heads // tp if tp <= model.kv_heads else 1
            if model.hybrid:
                self.layers = self._model_layers(cfg, tp)
            else:
                self.layers = {model.layer_name(i): self._layer(model, tp, kv_heads, model.layer_name(i))
                               for i in range(model.layers)}
            self.backends = get_current_attn_backends(cfg)
            specs = {n: layer.get_kv_cache_spec(cfg) for n, layer in self.layers.items()}
            layout = resolve_kv_cache_layout(cfg, [[x.name for x in get_supported_kv_cache_layouts(self.backends)]],
                                             list(specs.values()))
            self.layout = layout
            self.kv_cache_config = get_kv_cache_configs(cfg, [specs], [1 << 30])[0]
            self.kv_cache_config.kv_cache_layout = cfg.cache_config.kv_cache_layout
            self.block_size = cfg.cache_config.block_size  # CPU_MLA forces 16; hybrids: vLLM's choice unless given
            groups = []
            for gi, g in enumerate(self.kv_cache_config.kv_cache_groups):
                spec = g.kv_cache_spec
                kind = "mamba" if isinstance(spec, MambaSpec) else "mla" if isinstance(spec, MLAAttentionSpec) \
                    else "attn"
                groups.append(CacheGroup(f"{kind}{gi}", kind, tuple(g.layer_names)))
            self._groups = tuple(groups)
            # the kernel page of each group, as the model runner's prepare_kernel_block_sizes gives it: CPU
            # backends do not split blocks, a mamba group's is its spec's block (one state per block)
            self.kernel_block_sizes = [g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups]
            self.isa = ""
            if not model.mla:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
                self.isa = _get_attn_isa(torch.float32, self.block_size, model.head_dim)
                for g in self._groups:
                    for name in g.layers if g.kind == "attn" else ():
                        self.layers[name].isa = self.isa  # what CPU_ATTN's metadata builder sets on its layers
            self.caches: list[dict[str, torch.Tensor]] = []
            self.connectors: list[Any] = []
            for r in range(tp):
                self.caches.append(self.allocate())
                with _as_rank(r, tp):
                    self.connectors.append(NixlConnector(cfg, KVConnectorRole.WORKER, self.kv_cache_config))
            self.scheduler = NixlConnector(cfg, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.num_blocks = self.kv_cache_config.num_blocks
        self.kv_heads = kv_heads

    def allocate(self) -> dict[str, torch.Tensor]:
        """A cache for one rank as the worker allocates it (vLLM's ``allocate_kv_cache``)."""
        from vllm.v1.worker.utils import allocate_kv_cache

        return allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                 self.config.cache_config.get_resolved_kv_cache_layout(), self.kernel_block_sizes)

    def groups(self) -> tuple[CacheGroup, ...]:
        """vLLM's KV-cache groups of this side, in vLLM's order."""
        return self._groups

    def group_of(self, kind: str) -> CacheGroup:
        for g in self._groups:
            if g.kind == kind:
                return g
        raise KeyError(f"{self.engine_id}: no {kind} group in {[g.kind for g in self._groups]}")

    @staticmethod
    def _model_layers(cfg: Any, tp: int) -> dict[str, Any]:
        """The cache-holding layers of vLLM's own model class for the config (attention and mamba mixers)."""
        from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM

        if tp != 1:
            raise NotImplementedError("hybrid cells build vLLM's model class, whose layers read the TP size of "
                                      "this one-process world: TP1 only")
        NemotronHForCausalLM(vllm_config=cfg, prefix="")
        context = cfg.compilation_config.static_forward_context
        return {name: layer for name, layer in context.items() if hasattr(layer, "get_kv_cache_spec")}

    def mamba_views(self, rank: int, name: str, caches: dict[str, torch.Tensor] | None = None) -> tuple[Any, ...]:
        """A mamba layer's (conv, ssm) state views of ``caches`` (default: the rank's), unpacked by vLLM's own
        ``MambaBase.bind_kv_cache`` (the layer's binding is restored afterwards)."""
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        layer = self.layers[name]
        saved = getattr(layer, "kv_cache", None)
        MambaBase.bind_kv_cache(layer, (self.caches[rank] if caches is None else caches)[name])
        views = tuple(layer.kv_cache)
        layer.kv_cache = saved
        return views

    @staticmethod
    def _layer(model: TinyModel, tp: int, kv_heads: int, prefix: str) -> Any:
        """vLLM's own attention layer for ``prefix`` (it picks the backend and gives the cache spec)."""
        from vllm.config import get_current_vllm_config

        cache_config = get_current_vllm_config().cache_config
        if not model.mla:
            from vllm.model_executor.layers.attention import Attention

            return Attention(model.heads // tp, model.head_dim, model.head_dim ** -0.5, num_kv_heads=kv_heads,
                             cache_config=cache_config, prefix=prefix)
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.model_executor.layers.linear import ColumnParallelLinear
        from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

        backend = AMXMLABackend if model.backend == "AMX_MLA" else CPUMLABackend
        heads = model.heads // tp
        kv_b_proj = ColumnParallelLinear(KV_LORA_RANK, heads * 2 * NOPE_DIM, bias=False, prefix=f"{prefix}.kv_b_proj")
        return MLAAttention(heads, (NOPE_DIM + ROPE_DIM) ** -0.5, NOPE_DIM, ROPE_DIM, NOPE_DIM, None, KV_LORA_RANK,
                            kv_b_proj, cache_config=cache_config, prefix=prefix, attn_backend=backend)

    @property
    def backend_name(self) -> str:
        return self.attention_backend

    @property
    def attention_backend(self) -> str:
        """The attention backend's name (a hybrid's mamba backend is not it)."""
        names = [str(b.get_name()) for b in self.backends]
        return next((n for n in names if "MAMBA" not in n.upper()), names[0])

    def heads(self, rank: int) -> range:
        """The global KV heads ``rank`` holds (vLLM's head sharding; one replicated head past TP = heads)."""
        n = self.kv_heads
        first = rank * n if self.tp <= self.model.kv_heads else rank * self.model.kv_heads // self.tp
        return range(first, first + n)

    def worker(self, rank: int) -> Any:
        return self.connectors[rank].connector_worker

    def agent(self, rank: int) -> RecordingAgent:
        agent = self.worker(rank).nixl_wrapper
        if not isinstance(agent, RecordingAgent):
            raise TypeError(f"{self.engine_id} rank {rank}: the worker's NIXL agent is {type(agent).__name__}, "
                            "not the RecordingAgent it was built with")
        return agent

    def fill(self, value: float) -> None:
        for caches in self.caches:
            for cache in caches.values():
                cache.fill_(value)

    def write_tokens(self, rank: int, blocks: list[int], tokens: range, values: Any,
                     caches: dict[str, torch.Tensor] | None = None) -> None:
        """Write K and V of ``tokens`` (placed by token in ``blocks``) on ``rank`` through CPU_ATTN's own update.

        ``values(layer, tokens, plane)`` gives a ``(len(tokens), kv_heads, head_dim)`` float32 tensor;
        ``caches`` (default: the rank's registered caches) is where they go.
        """
        target = self.caches[rank] if caches is None else caches
        from vllm.config import set_current_vllm_config

        t = torch.tensor(list(tokens), dtype=torch.long)
        if not len(t):
            return
        ids = torch.tensor(blocks, dtype=torch.long)
        slots = ids[t // self.block_size] * self.block_size + t % self.block_size
        attention = [n for g in self._groups if g.kind != "mamba" for n in g.layers]
        with set_current_vllm_config(self.config):
            for i, name in enumerate(attention):
                layer = self.layers[name]
                if self.model.mla:  # the latent: kv_c (512) then k_pe (64), one "head"
                    latent = values(i, t, 0)
                    layer.impl.do_kv_cache_update(latent[:, 0, :KV_LORA_RANK].contiguous(),
                                                  latent[:, :, KV_LORA_RANK:].contiguous(),
                                                  target[name].squeeze(1),  # as MLAAttention.bind_kv_cache binds it
                                                  slots, "auto", layer._k_scale)
                    continue
                key, value = values(i, t, 0), values(i, t, 1)
                layer.impl.do_kv_cache_update(layer, key, value, target[name], slots)

    def write_states(self, rank: int, block: int, values: Any, caches: dict[str, torch.Tensor] | None = None) -> None:
        """Write every mamba layer's state at ``block`` on ``rank`` through vLLM's own state views:
        ``values(layer, section, shape, dtype)`` gives the tensor of one section (0 conv, 1 ssm)."""
        for i, name in enumerate(n for g in self._groups if g.kind == "mamba" for n in g.layers):
            for k, view in enumerate(self.mamba_views(rank, name, caches)):
                view[block].copy_(values(i, k, tuple(view.shape[1:]), view.dtype))

    def watch_handshake(self, rank: int) -> list[str]:
        """Errors vLLM's handshake raises on ``rank`` (it only logs them), collected in the returned list."""
        worker = self.worker(rank)
        errors: list[str] = []
        original = worker.add_remote_agent

        def add_remote_agent(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except Exception as e:
                errors.append(f"D rank {rank} handshake (add_remote_agent): {type(e).__name__}: {e}".strip())
                raise

        worker.add_remote_agent = add_remote_agent
        return errors

    def register(self) -> None:
        """Each rank registers its caches with NIXL; P's scheduler serves the handshake metadata."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.config):
            for r, conn in enumerate(self.connectors):
                conn.register_kv_caches(self.caches[r])
            self.scheduler.set_xfer_handshake_metadata_pp_aware(
                {(0, r): conn.connector_worker.xfer_handshake_metadata for r, conn in enumerate(self.connectors)})

    def shutdown(self) -> None:
        for conn in [*self.connectors, self.scheduler]:
            with contextlib.suppress(Exception):
                conn.shutdown()
