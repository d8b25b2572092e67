"""Tiny checkpoints for real vLLM, written by the tests themselves (no hub, no ``load_format="dummy"``).

A model directory is ``config.json`` plus ``model.safetensors`` with random float32 weights drawn
from a fixed seed, so every process that loads it (monolithic, P, D, any TP size) runs the same
model. ``load_format="dummy"`` is avoided on purpose: it gives degenerate repeating tokens (a wrong
KV cache can still produce "equal" tokens) and seeds each TP shard on its own.

The safetensors file is written here with numpy (the format is an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the raw bytes), so
this module needs neither torch nor the ``safetensors`` package and runs in the test process.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MODELS", "model_config", "write_model", "write_safetensors", "prompts"]

#: The tiny models the end-to-end tests run: 2 layers, hidden 256, 8 query heads, 4 KV heads of 32,
#: vocabulary 1024. ``mistral-sw`` is the same shape with a sliding window on every layer (vLLM gives
#: it a ``SlidingWindowSpec`` KV group), smaller than the longer prompts so the window matters.
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "mistral-sw": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 128},
    "nemotron-h": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"},
    "deepseek": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
    "qwen3-next": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
}

#: The Qwen3-Next-like hybrid (``qwen3-next``, run in bfloat16: vLLM's CPU GDN kernels need it, and
#: head_dim 64): layers 0-2 gated DeltaNet (2 key heads, 4 value heads, heads of 64, conv kernel 4:
#: in_proj_qkvz 2 * 128 + 2 * 256 = 768 rows, conv channels 2 * 128 + 256 = 512), layer 3 gated
#: attention (4 query heads, 2 KV heads of 64) with a small MoE (4 experts, top 2, a shared expert:
#: vLLM's Qwen3-Next needs one MoE layer); weights are written as float32, vLLM casts them.
QN_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
QN_HEADS, QN_KV_HEADS, QN_HEAD_DIM, QN_K_HEADS, QN_V_HEADS, QN_EXPERTS = 4, 2, 64, 2, 4, 4

#: The DeepSeek-V2-like MLA model (``deepseek``): 2 dense layers (no routed experts below
#: ``first_k_dense_replace``), 8 heads, a KV latent of 512 + 64 rope dims (vLLM's CPU_MLA caches
#: 576 floats per token), q/k nope 32, v 32, no q LoRA.
KV_LORA_RANK, ROPE_DIM, NOPE_DIM, V_DIM = 512, 64, 32, 32

#: The Nemotron-H-like hybrid (``nemotron-h``): layers 0 and 2 mamba2 mixers (8 heads of 32, 2 groups,
#: state 16, conv kernel 4: in_proj 2 * 256 + 2 * 2 * 16 + 8 = 584 rows, conv channels 256 + 2 * 2 * 16 =
#: 320), layers 1 and 3 attention (8 query heads, 4 KV heads of 32). Weights carry the checkpoint's names
#: (``backbone.``, ``embeddings``, ``A_log``, separate q/k/v), which vLLM maps onto its own.
HYBRID_PATTERN = "M*M*"
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, MAMBA_STATE, MAMBA_CONV = 8, 32, 2, 16, 4

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS, FFN = 256, 8, 4, 32, 1024, 2, 512


def model_config(kind: str) -> dict[str, Any]:
    """The HF ``config.json`` of the tiny model ``kind`` (a key of :data:`MODELS`)."""
    if kind not in MODELS:
        raise ValueError(f"unknown tiny model {kind!r}; known: {sorted(MODELS)}")
    if kind == "qwen3-next":
        return {
            **MODELS[kind], "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": len(QN_TYPES),
            "num_attention_heads": QN_HEADS, "num_key_value_heads": QN_KV_HEADS, "head_dim": QN_HEAD_DIM,
            "layer_types": list(QN_TYPES), "full_attention_interval": len(QN_TYPES),
            "linear_num_key_heads": QN_K_HEADS, "linear_num_value_heads": QN_V_HEADS,
            "linear_key_head_dim": QN_HEAD_DIM, "linear_value_head_dim": QN_HEAD_DIM, "linear_conv_kernel_dim": 4,
            "num_experts": QN_EXPERTS, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "moe_intermediate_size": HIDDEN, "shared_expert_intermediate_size": HIDDEN,
            "mlp_only_layers": [i for i, t in enumerate(QN_TYPES) if t == "linear_attention"], "norm_topk_prob": True,
            "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25, "hidden_act": "silu", "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
        }
    if kind == "deepseek":
        return {
            **MODELS[kind], "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "moe_intermediate_size": HIDDEN,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS,
            "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None, "qk_nope_head_dim": NOPE_DIM,
            "qk_rope_head_dim": ROPE_DIM, "v_head_dim": V_DIM, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": LAYERS, "vocab_size": VOCAB,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
            "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        }
    if kind == "nemotron-h":
        return {
            **MODELS[kind], "hidden_size": HIDDEN, "intermediate_size": FFN, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hybrid_override_pattern": HYBRID_PATTERN,
            "num_hidden_layers": len(HYBRID_PATTERN), "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "ssm_state_size": MAMBA_STATE, "mamba_num_heads": MAMBA_HEADS, "mamba_head_dim": MAMBA_HEAD_DIM,
            "n_groups": MAMBA_GROUPS, "conv_kernel": MAMBA_CONV, "expand": 1, "layer_norm_epsilon": 1e-5,
            "torch_dtype": "float32", "tie_word_embeddings": False, "mlp_hidden_act": "relu2", "chunk_size": 128,
            "use_conv_bias": True, "use_bias": False, "mlp_bias": False, "mamba_hidden_act": "silu",
            "mamba_ssm_cache_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        }
    return {
        **MODELS[kind],
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
    }


class _Draws:
    """Weights ~N(0, 0.06) as float32, drawn in call order from one seed (``one``: 1 + such a draw,
    for norms)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape: int) -> np.ndarray:
        return self.rng.normal(0.0, 0.06, size=shape).astype(np.float32)

    def one(self, *shape: int) -> np.ndarray:
        return (1.0 + self(*shape)).astype(np.float32)


def _mlp_and_norms(out: dict[str, np.ndarray], p: str, w: _Draws, ffn: int) -> None:
    """A Llama-style layer's gated MLP and its two RMS norms, under prefix ``p``."""
    out[p + "mlp.gate_proj.weight"] = w(ffn, HIDDEN)
    out[p + "mlp.up_proj.weight"] = w(ffn, HIDDEN)
    out[p + "mlp.down_proj.weight"] = w(HIDDEN, ffn)
    out[p + "input_layernorm.weight"] = w.one(HIDDEN)
    out[p + "post_attention_layernorm.weight"] = w.one(HIDDEN)


def _weights(seed: int) -> dict[str, np.ndarray]:
    w = _Draws(seed)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        _mlp_and_norms(out, p, w, FFN)
    out["model.norm.weight"] = w.one(HIDDEN)
    out["lm_head.weight"] = w(VOCAB, HIDDEN)
    return out


def _hybrid_weights(seed: int) -> dict[str, np.ndarray]:
    """The ``nemotron-h`` checkpoint, under the names of NVIDIA's Nemotron-H checkpoints."""
    w = _Draws(seed)

    inner = MAMBA_HEADS * MAMBA_HEAD_DIM
    conv = inner + 2 * MAMBA_GROUPS * MAMBA_STATE
    out = {"backbone.embeddings.weight": w(VOCAB, HIDDEN)}
    for i, kind in enumerate(HYBRID_PATTERN):
        p = f"backbone.layers.{i}."
        out[p + "norm.weight"] = w.one(HIDDEN)
        if kind == "M":
            out[p + "mixer.in_proj.weight"] = w(inner + conv + MAMBA_HEADS, HIDDEN)
            out[p + "mixer.conv1d.weight"] = w(conv, 1, MAMBA_CONV)
            out[p + "mixer.conv1d.bias"] = w(conv)
            out[p + "mixer.A_log"] = w(MAMBA_HEADS)  # vLLM loads A = -exp(A_log)
            out[p + "mixer.D"] = w(MAMBA_HEADS)
            out[p + "mixer.dt_bias"] = w(MAMBA_HEADS)
            out[p + "mixer.norm.weight"] = w.one(inner)
            out[p + "mixer.out_proj.weight"] = w(HIDDEN, inner)
        else:
            out[p + "mixer.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
            out[p + "mixer.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
            out[p + "mixer.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
            out[p + "mixer.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
    out["backbone.norm_f.weight"] = w.one(HIDDEN)
    out["lm_head.weight"] = w(VOCAB, HIDDEN)
    return out


def _mla_weights(seed: int) -> dict[str, np.ndarray]:
    """The ``deepseek`` checkpoint, under DeepSeek-V2's names."""
    w = _Draws(seed)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(HEADS * (NOPE_DIM + ROPE_DIM), HIDDEN)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = w(KV_LORA_RANK + ROPE_DIM, HIDDEN)
        out[p + "self_attn.kv_a_layernorm.weight"] = w.one(KV_LORA_RANK)
        out[p + "self_attn.kv_b_proj.weight"] = w(HEADS * (NOPE_DIM + V_DIM), KV_LORA_RANK)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * V_DIM)
        _mlp_and_norms(out, p, w, 2 * HIDDEN)
    out["model.norm.weight"] = w.one(HIDDEN)
    out["lm_head.weight"] = w(VOCAB, HIDDEN)
    return out


def _gdn_weights(seed: int) -> dict[str, np.ndarray]:
    """The ``qwen3-next`` checkpoint, under Qwen3-Next's names (float32; vLLM casts to bfloat16)."""
    w = _Draws(seed)
    one = w.one

    kd, vd = QN_K_HEADS * QN_HEAD_DIM, QN_V_HEADS * QN_HEAD_DIM
    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    for i, kind in enumerate(QN_TYPES):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = one(HIDDEN)
        out[p + "post_attention_layernorm.weight"] = one(HIDDEN)
        if kind == "linear_attention":
            a = p + "linear_attn."
            out[a + "in_proj_qkvz.weight"] = w(2 * kd + 2 * vd, HIDDEN)
            out[a + "in_proj_ba.weight"] = w(2 * QN_V_HEADS, HIDDEN)
            out[a + "conv1d.weight"] = w(2 * kd + vd, 1, 4)
            out[a + "A_log"] = w(QN_V_HEADS)
            out[a + "dt_bias"] = w(QN_V_HEADS)
            out[a + "norm.weight"] = one(QN_HEAD_DIM)
            out[a + "out_proj.weight"] = w(HIDDEN, vd)
            out[p + "mlp.gate_proj.weight"] = w(2 * HIDDEN, HIDDEN)
            out[p + "mlp.up_proj.weight"] = w(2 * HIDDEN, HIDDEN)
            out[p + "mlp.down_proj.weight"] = w(HIDDEN, 2 * HIDDEN)
            continue
        a = p + "self_attn."
        out[a + "q_proj.weight"] = w(2 * QN_HEADS * QN_HEAD_DIM, HIDDEN)  # queries and their output gates
        out[a + "k_proj.weight"] = w(QN_KV_HEADS * QN_HEAD_DIM, HIDDEN)
        out[a + "v_proj.weight"] = w(QN_KV_HEADS * QN_HEAD_DIM, HIDDEN)
        out[a + "o_proj.weight"] = w(HIDDEN, QN_HEADS * QN_HEAD_DIM)
        out[a + "q_norm.weight"] = one(QN_HEAD_DIM)
        out[a + "k_norm.weight"] = one(QN_HEAD_DIM)
        out[p + "mlp.gate.weight"] = w(QN_EXPERTS, HIDDEN)
        out[p + "mlp.shared_expert_gate.weight"] = w(1, HIDDEN)
        for e in ["shared_expert"] + [f"experts.{j}" for j in range(QN_EXPERTS)]:
            out[p + f"mlp.{e}.gate_proj.weight"] = w(HIDDEN, HIDDEN)
            out[p + f"mlp.{e}.up_proj.weight"] = w(HIDDEN, HIDDEN)
            out[p + f"mlp.{e}.down_proj.weight"] = w(HIDDEN, HIDDEN)
    out["model.norm.weight"] = one(HIDDEN)
    out["lm_head.weight"] = w(VOCAB, HIDDEN)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 ``tensors`` as one safetensors file (header, then the C-order bytes of each)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        if arr.dtype != np.float32:
            raise ValueError(f"{name}: dtype {arr.dtype}, only float32 is written here")
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def write_model(directory: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write the tiny model ``kind`` into ``directory`` (made if needed); return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(kind), indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    weights = {"nemotron-h": _hybrid_weights, "deepseek": _mla_weights, "qwen3-next": _gdn_weights}.get(kind, _weights)(seed)
    write_safetensors(directory / "model.safetensors", weights)
    return directory


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Token-id prompts of the given lengths, drawn from ``seed`` (ids 3..VOCAB-1: no BOS/EOS inside)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]
