"""Named prefill/decode pairs as the serving stacks configure them, for the CLI, tests and notebooks.

A preset turns a prompt length into two engine geometries and a request on fresh blocks::

    Preset.build(tokens=M, prefix=S)
        -> prefill engine  (P: TP, kernel page K, ppl, layout)   P lists blocks for [0, M)
        -> decode engine   (D: TP, kernel page K, ppl, layout)   D lists blocks for [S, N)
        -> Request via kvgeom.values.pair.fresh_request                  N = M (attention), M + 1 (hybrids)

``tokens`` is M, the prompt tokens P computes and sends. Hybrid models follow vLLM's mamba N-1
rule: P prefills M = N - 1 tokens and D allocates blocks for N = M + 1 (it recomputes the last
token to derive the final state). Request block ids start at 1 on P and at 2 on D so that every
listed block has a neighbour in use on both sides (a write one block off lands in a real block),
and every region holds the request's blocks plus one spare: caches stay a few times the request.

Model facts (head counts, head sizes, state sections) and TP / kernel / logical block sizes are
the real ones. Layer counts default to the real ones for pure-attention models and to 2 per group
for hybrids (whose 4-6 MiB state pages make every layer expensive to simulate); ``layers=`` and
``kvgeom plan --layers`` override them.

Where the numbers come from (public model configs; vLLM's hybrid block rule):

* Llama-3-8B / 70B: 32 / 80 layers, 8 KV heads of 128 dims, bf16 -> head_bytes = 128 * 2 = 256.
  vLLM's default block is 16 tokens, and the NIXL connector wants HND pages with K/V packed.
* DeepSeek-V3: 61 layers of MLA, latent = kv_lora_rank 512 + rope 64 = 576 values, bf16 ->
  head_bytes = 1152, FlashMLA pages of 64 tokens, replicated on every TP rank.
* Qwen-like sliding window: 28 layers, 4 KV heads of 128 dims (Qwen2.5-7B). Qwen2 configs carry a
  window (4096 and up) that applies to the layers from ``max_window_layers`` on; we split the
  layers into a full and a sliding group and shrink the window to 256 tokens so a few hundred
  tokens already show different tail windows on the two sides.
* Hybrid logical blocks (vLLM ``_align_hybrid_block_size``): the logical block grows, in kernel
  pages, until one attention layer's logical page holds one layer's state on that rank:
  ``ppl = ceil(state_bytes_per_rank / attention_kernel_page_bytes)``. Worked number, Nemotron-H
  TP1: state = x 8192*3*2 + B 1024*3*2 + C 1024*3*2 + ssm 128 heads * 64*128*4 = 4,255,744 B,
  attention page = 2 planes * 8 heads * 16 tokens * 256 B = 65,536 B -> ppl = 65 (1040 tokens).
* KimiLinear (48B-A3B): MLA (576 bf16 -> 1152 B, FlashMLA 64-token pages) interleaved with KDA
  layers (32 heads of 128: conv q, k, v of 4096 channels x 3 rows bf16, recurrent state 32 heads
  x 128 x 128 fp32). vLLM sizes its logical block at 5760 tokens on TP1 and 768 on TP8 (ppl 90 vs
  12, vllm issue #41037); we take those numbers as given. Like vLLM's geometry harness, the KDA
  layers form two groups overlaid with the MLA layers on shared regions.
* Nemotron-H-8B: attention 8 KV heads of 128 dims; Mamba2 128 heads of 64 dims, state 128,
  n_groups 8, conv kernel 4 -> conv x 8192 channels, B and C 8 * 128 = 1024 channels each, 3 rows
  bf16; ssm 128 heads x (64 x 128) fp32 (vLLM's ``mamba_ssm_cache_dtype=float32``).
* Qwen3-Next-80B-A3B: gated attention with 2 KV heads of 256 dims (head_bytes 512, replicated on
  TP4); Gated DeltaNet with 16 key heads and 32 value heads of 128 dims, conv kernel 4 -> conv
  q 2048, k 2048, v 4096 channels x 3 rows bf16, recurrent state 32 heads x 128 x 128 fp32.
* Topologies (docs/design.md §11). Pipeline stages split the global layers by vLLM's
  ``get_pp_indices`` rule (80 layers on PP2: 40 + 40). DeepSeek-V3 under DCP keeps its 64-token
  FlashMLA pages: with DCP8 a logical block covers 64 * 8 = 512 request tokens. The DCP8 preset
  uses interleave 64 (whole kernel pages per rank, what vLLM's NIXL connector switches
  ``cp_kv_cache_interleave_size`` to), the DCP4 -> DCP2 preset interleave 1 (vLLM's default,
  token round robin). KimiLinear on PP2 x TP4 takes ppl 24 (1536-token blocks): three times the
  one-layer rule (8 at TP4), the same factor vLLM's numbers show at TP1 (90 = 3 x 30) and TP8
  (12 = 3 x 4).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import attrs

from ..arith.ints import ceil_div
from ..arith.shard import local_count
from ..errors import GeometryError, KvGeomError, RequestError, value_text
from ..planning.budget import DEFAULT_BUDGET, PlanBudget
from ..planning.packed import DEFAULT_STAGING_BYTES
from ..planning.transfer import Pair, check_budget
from ..values.engine import EngineGeometry
from ..values.fields import check_int, is_int
from ..values.model import AttentionSpec, GroupSpec, ModelSpec, StateSection, StateSpec
from ..values.request import Request
from ..values.topology import Topology
from .requests import fresh_request, fresh_shape, fresh_span

__all__ = [
    "Preset",
    "PRESETS",
    "DEFAULT_PRESET",
    "UnknownPreset",
    "get_preset",
    "hybrid_blocks_per_logical",
]

PREFILL_FIRST_BLOCK = 1  # P's request blocks start at id 1: block 0 is a neighbour in use
DECODE_FIRST_BLOCK = 2  # D's at id 2: a P/D id mix-up lands in the wrong block, visibly
SPARE_BLOCKS = 1  # one block past the request's last one, also a neighbour


class UnknownPreset(KvGeomError):
    """No preset has that name; the message lists the valid ones."""


# An engine factory: (prefill num_blocks, decode num_blocks, layers per group) -> (P, D).
EngineFactory = Callable[[int, int, int], tuple[EngineGeometry, EngineGeometry]]


@attrs.frozen
class Preset:
    """A named P/D pair: ``build(tokens, prefix)`` gives the :class:`Pair` and a fresh request.

    ``hybrid`` presets list D blocks for ``tokens + 1`` tokens (the mamba N-1 rule);
    ``pairable=False`` marks the demo whose engines :func:`kvgeom.pairable` rejects (its
    :meth:`build` raises :class:`~kvgeom.errors.IncompatibleGeometry`; use :meth:`geometries`).
    """

    name: str
    description: str
    factory: EngineFactory = attrs.field(repr=False)
    default_layers: int
    default_tokens: int = 256
    default_prefix: int = 0
    hybrid: bool = False
    pairable: bool = True
    min_layers: int = 1  # layers per group a preset needs (a pipeline stage needs at least one layer)

    def decode_tokens(self, tokens: int) -> int:
        """N, the tokens D allocates blocks for: M + 1 for hybrids, M otherwise."""
        return tokens + 1 if self.hybrid else tokens

    def geometries(
        self, tokens: int | None = None, prefix: int | None = None, *, layers: int | None = None
    ) -> tuple[EngineGeometry, EngineGeometry]:
        """Both engines, their block pools sized for a ``tokens``-token request with ``prefix`` hit."""
        tokens, prefix, layers = self._arguments(tokens, prefix, layers)
        small_p, small_d = self.factory(1, 1, layers)
        p_blocks = PREFILL_FIRST_BLOCK + _blocks_needed(small_p, tokens, 0, tokens) + SPARE_BLOCKS
        d_blocks = (DECODE_FIRST_BLOCK + _blocks_needed(small_d, tokens, prefix, self.decode_tokens(tokens))
                    + SPARE_BLOCKS)
        return self.factory(p_blocks, d_blocks, layers)

    def build(
        self, tokens: int | None = None, prefix: int | None = None, *, layers: int | None = None,
        budget: PlanBudget | None = DEFAULT_BUDGET, strategy: str = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> tuple[Pair, Request]:
        """The pair and a request on fresh blocks: P computed ``tokens``, D holds ``[0, prefix)``.

        ``tokens`` and ``prefix`` default to the preset's (:meth:`resolve`, as ``kvgeom plan`` does:
        ``get_preset("gqa-tp2-tp4").build()`` is M = 100 with a 16-token prefix hit).

        Raises :class:`~kvgeom.errors.IncompatibleGeometry` for the unpairable demo,
        :class:`~kvgeom.errors.RequestError` when ``prefix`` is not on a D block boundary, and
        :class:`~kvgeom.errors.PlanBudgetExceeded` when planning the request under ``strategy``
        would exceed ``budget`` (checked before the request's block lists are built; a packed plan
        with ``staging_bytes`` per rank).
        """
        tokens, prefix, layers = self._arguments(tokens, prefix, layers)
        prefill, decode = self.geometries(tokens, prefix, layers=layers)
        pair = Pair(prefill, decode)
        if budget is not None:
            shape = fresh_shape(pair, tokens, decode_tokens=self.decode_tokens(tokens), prefix_hit_tokens=prefix)
            check_budget(pair, shape, strategy, staging_bytes=staging_bytes, budget=budget)
        request = fresh_request(
            pair,
            tokens,
            decode_tokens=self.decode_tokens(tokens),
            prefix_hit_tokens=prefix,
            prefill_first_block=PREFILL_FIRST_BLOCK,
            decode_first_block=DECODE_FIRST_BLOCK,
        )
        pair.check_request(request)
        return pair, request

    def resolve(self, tokens: int | None = None, prefix: int | None = None) -> tuple[int, int]:
        """M and S for ``tokens``/``prefix`` given or not: the preset's defaults, its prefix only when
        it is below the tokens (``kvgeom plan --tokens 8`` on a preset with a 16-token prefix: S = 0)."""
        tokens = self.default_tokens if tokens is None else tokens
        if prefix is None:
            prefix = self.default_prefix if is_int(tokens) and self.default_prefix < tokens else 0
        return tokens, prefix

    def _arguments(self, tokens: int | None, prefix: int | None, layers: int | None) -> tuple[int, int, int]:
        tokens, prefix = self.resolve(tokens, prefix)
        layers = self.default_layers if layers is None else layers
        check_int("tokens", tokens, minimum=1, error=RequestError)
        check_int("prefix", prefix, minimum=0, error=RequestError)
        check_int("layers", layers, minimum=self.min_layers)
        if prefix > tokens:
            raise RequestError("prefix", f"a prefix hit of {prefix} tokens exceeds the {tokens} computed tokens",
                               actual=prefix, expected=f"<= {tokens}", fix="use a smaller --prefix")
        return tokens, prefix, layers


def _blocks_needed(engine: EngineGeometry, computed_tokens: int, lo: int, hi: int) -> int:
    """Logical block ids :func:`fresh_request` hands out on ``engine`` for tokens ``[lo, hi)``."""
    total = 0
    for spec in engine.model.groups:
        if isinstance(spec, StateSpec):
            total += 1  # one running state
            continue
        total += fresh_span(spec, engine.logical_block_tokens, computed_tokens, lo, hi)[1]
    return total


def hybrid_blocks_per_logical(model: ModelSpec, *, tp: int, kernel_block_tokens: int, dcp: int = 1) -> int:
    """vLLM's hybrid rule: the fewest kernel pages per logical block whose attention page holds a state.

    ``ceil(max state bytes per rank / max attention kernel page bytes per rank)``, one layer each.
    With DCP a rank's attention heads are those of its head group (``tp // dcp`` groups,
    docs/design.md §11.1); state stays sliced over ``tp``.
    """
    page = 0
    state = 0
    for spec in model.groups:
        if isinstance(spec, AttentionSpec):
            heads = local_count(spec.num_kv_heads, tp // dcp, replicated=spec.replicated)
            page = max(page, spec.planes * heads * kernel_block_tokens * spec.head_bytes)
        else:
            state = max(state, sum(local_count(s.channels, tp, replicated=s.replicated) * s.channel_bytes
                                   for s in spec.sections))
    if not page:
        raise GeometryError("model.groups", "a hybrid needs an attention group to size its logical block",
                            actual=[g.name for g in model.groups])
    return max(1, ceil_div(state, page))


# ---- model facts -----------------------------------------------------------------------------------

def _llama(name: str, layers: int, head_bytes: int = 256, dtype: str = "bfloat16") -> ModelSpec:
    return ModelSpec(name, (AttentionSpec("attn", "full", layers, 8, head_bytes),), dtype)


def _deepseek(layers: int) -> ModelSpec:
    return ModelSpec("deepseek-v3-like", (AttentionSpec("mla", "mla", layers, 1, 576 * 2),))


def _qwen_swa(layers: int) -> ModelSpec:
    return ModelSpec("qwen2.5-7b-like+swa", (
        AttentionSpec("full", "full", layers, 4, 256),
        AttentionSpec("sliding", "sliding", layers, 4, 256, window_tokens=256),
    ))


def _kda(name: str, layers: int) -> StateSpec:
    return StateSpec(name, layers, (
        StateSection("conv_q", channels=32 * 128, unit_bytes=2, rows=3),
        StateSection("conv_k", channels=32 * 128, unit_bytes=2, rows=3),
        StateSection("conv_v", channels=32 * 128, unit_bytes=2, rows=3),
        StateSection("recurrent", channels=32, unit_bytes=128 * 128 * 4),
    ))


def _kimi(layers: int) -> ModelSpec:
    groups: tuple[GroupSpec, ...] = (
        AttentionSpec("mla", "mla", layers, 1, 576 * 2), _kda("kda_a", layers), _kda("kda_b", layers),
    )
    return ModelSpec("kimi-linear-like", groups)


def _nemotron_h(layers: int) -> ModelSpec:
    mamba = StateSpec("mamba", layers, (
        StateSection("x", channels=128 * 64, unit_bytes=2, rows=3),
        StateSection("B", channels=8 * 128, unit_bytes=2, rows=3),
        StateSection("C", channels=8 * 128, unit_bytes=2, rows=3),
        StateSection("ssm", channels=128, unit_bytes=64 * 128 * 4),
    ))
    return ModelSpec("nemotron-h-8b-like", (AttentionSpec("attn", "full", layers, 8, 256), mamba))


def _qwen3_next(layers: int) -> ModelSpec:
    gdn = StateSpec("gdn", layers, (
        StateSection("conv_q", channels=16 * 128, unit_bytes=2, rows=3),
        StateSection("conv_k", channels=16 * 128, unit_bytes=2, rows=3),
        StateSection("conv_v", channels=32 * 128, unit_bytes=2, rows=3),
        StateSection("recurrent", channels=32, unit_bytes=128 * 128 * 4),
    ))
    return ModelSpec("qwen3-next-like", (AttentionSpec("attn", "full", layers, 2, 512), gdn))


# ---- engine factories ------------------------------------------------------------------------------

def _attention_pair(
    model: Callable[[int], ModelSpec],
    p: dict[str, Any],
    d: dict[str, Any],
    d_model: Callable[[int], ModelSpec] | None = None,
) -> EngineFactory:
    """A factory for two pure-attention engines: ``p``/``d`` are EngineGeometry.build keywords."""

    def factory(p_blocks: int, d_blocks: int, layers: int) -> tuple[EngineGeometry, EngineGeometry]:
        prefill = EngineGeometry.build(model(layers), num_blocks=p_blocks, name="prefill", **p)
        decode = EngineGeometry.build((d_model or model)(layers), num_blocks=d_blocks, name="decode", **d)
        return prefill, decode

    return factory


def _hybrid_pair(
    model: Callable[[int], ModelSpec],
    *,
    p_tp: int,
    d_tp: int,
    kernel: int,
    p_ppl: int | None = None,
    d_ppl: int | None = None,
    p_topology: Topology | None = None,
    d_topology: Topology | None = None,
) -> EngineFactory:
    """Two hybrid engines on shared regions (per pipeline stage), ppl from vLLM's rule unless given."""

    def factory(p_blocks: int, d_blocks: int, layers: int) -> tuple[EngineGeometry, EngineGeometry]:
        m = model(layers)
        out = []
        for name, tp, ppl, blocks, topo in (("prefill", p_tp, p_ppl, p_blocks, p_topology),
                                            ("decode", d_tp, d_ppl, d_blocks, d_topology)):
            ppl = ppl or hybrid_blocks_per_logical(m, tp=tp, kernel_block_tokens=kernel)
            out.append(EngineGeometry.build(m, tp=tp, kernel_block_tokens=kernel, blocks_per_logical=ppl,
                                            num_blocks=blocks, layout="HND", kv="packed", regions="shared",
                                            name=name, topology=topo))
        return out[0], out[1]

    return factory


_HND16 = {"kernel_block_tokens": 16, "layout": "HND", "kv": "packed"}


def _presets() -> dict[str, Preset]:
    items = [
        Preset(
            "gqa-tp2-tp4",
            "Llama-3-8B-like GQA (8 KV heads x 256 B), 4 of 32 layers: P TP2 16-token NHD pages, K/V in "
            "separate regions (FlashAttention) -> D TP4 8-token HND pages, K/V packed; D has a 16-token prefix hit",
            _attention_pair(lambda n: _llama("llama-3-8b-like", n),
                            {"tp": 2, "kernel_block_tokens": 16, "layout": "NHD", "kv": "split"},
                            {"tp": 4, "kernel_block_tokens": 8, "layout": "HND", "kv": "packed"}),
            default_layers=4, default_tokens=100, default_prefix=16,
        ),
        Preset(
            "llama3-70b-tp8-tp4",
            "Llama-3-70B-like GQA, 80 layers, 8 KV heads x 256 B: P TP8 -> D TP4, 16-token HND pages, "
            "K/V packed (vLLM + NIXL defaults)",
            _attention_pair(lambda n: _llama("llama-3-70b-like", n), {"tp": 8, **_HND16}, {"tp": 4, **_HND16}),
            default_layers=80, default_tokens=200,
        ),
        Preset(
            "llama3-70b-tp4-tp8",
            "Llama-3-70B-like GQA, 80 layers, 8 KV heads x 256 B: P TP4 -> D TP8, 16-token HND pages, "
            "K/V packed",
            _attention_pair(lambda n: _llama("llama-3-70b-like", n), {"tp": 4, **_HND16}, {"tp": 8, **_HND16}),
            default_layers=80, default_tokens=200,
        ),
        Preset(
            "deepseek-v3-tp8-tp1",
            "DeepSeek-V3-like MLA, 61 layers, latent 576 bf16 = 1152 B replicated on every rank: "
            "P TP8 -> D TP1, 64-token FlashMLA pages",
            _attention_pair(_deepseek, {"tp": 8, "kernel_block_tokens": 64}, {"tp": 1, "kernel_block_tokens": 64}),
            default_layers=61, default_tokens=200,
        ),
        Preset(
            "qwen-swa-tp2-tp4",
            "Qwen2.5-7B-like, 28 layers as 14 full + 14 sliding-window (window shrunk to 256 tokens), "
            "4 KV heads x 256 B: P TP2 16-token pages -> D TP4 32-token pages, HND",
            _attention_pair(_qwen_swa, {"tp": 2, **_HND16}, {"tp": 4, **{**_HND16, "kernel_block_tokens": 32}}),
            default_layers=14, default_tokens=600,
        ),
        Preset(
            "kimi-linear-tp8-tp1",
            "KimiLinear-like MLA (1152 B) + two KDA state groups on shared regions, 2 layers per group: "
            "P TP8 768/64 (ppl 12) -> D TP1 5760/64 (ppl 90) logical/kernel tokens",
            _hybrid_pair(_kimi, p_tp=8, d_tp=1, kernel=64, p_ppl=12, d_ppl=90),
            default_layers=2, default_tokens=1000, hybrid=True,
        ),
        Preset(
            "kimi-linear-tp1-tp8",
            "KimiLinear-like, the reverse: P TP1 5760/64 (ppl 90) -> D TP8 768/64 (ppl 12), 2 layers per group",
            _hybrid_pair(_kimi, p_tp=1, d_tp=8, kernel=64, p_ppl=90, d_ppl=12),
            default_layers=2, default_tokens=1000, hybrid=True,
        ),
        Preset(
            "nemotron-h-tp1-tp4",
            "Nemotron-H-8B-like Mamba2 (conv x/B/C + ssm by heads) + GQA attention on shared regions, "
            "2 layers per group: P TP1 -> D TP4, 16-token HND pages, 1040-token logical blocks (ppl 65)",
            _hybrid_pair(_nemotron_h, p_tp=1, d_tp=4, kernel=16),
            default_layers=2, default_tokens=300, hybrid=True,
        ),
        Preset(
            "nemotron-h-tp4-tp1",
            "Nemotron-H-8B-like, the reverse: P TP4 -> D TP1, 2 layers per group",
            _hybrid_pair(_nemotron_h, p_tp=4, d_tp=1, kernel=16),
            default_layers=2, default_tokens=300, hybrid=True,
        ),
        Preset(
            "qwen3-next-tp2-tp4",
            "Qwen3-Next-like Gated DeltaNet (conv q/k/v + recurrent state by heads) + attention with 2 KV "
            "heads x 512 B (replicated on TP4), 2 layers per group: P TP2 (ppl 66) -> D TP4 (ppl 33), 16-token pages",
            _hybrid_pair(_qwen3_next, p_tp=2, d_tp=4, kernel=16),
            default_layers=2, default_tokens=300, hybrid=True,
        ),
        Preset(
            "llama3-70b-pp2tp4-tp8",
            "Llama-3-70B-like GQA, 80 layers, 8 KV heads x 256 B: P PP2 x TP4 (layers 0-39 and 40-79, 8 ranks) "
            "-> D TP8, 16-token HND pages, K/V packed; each D rank reads its head from one P rank per stage",
            _attention_pair(lambda n: _llama("llama-3-70b-like", n), {"tp": 4, **_HND16, "topology": Topology(pp=2)},
                            {"tp": 8, **_HND16}),
            default_layers=80, default_tokens=200, min_layers=2,
        ),
        Preset(
            "deepseek-v3-tp8-dcp8",
            "DeepSeek-V3-like MLA, 61 layers, latent 1152 B: P TP8 -> D TP8 with DCP8 (interleave 64: each D "
            "rank holds every 8th 64-token page), 64-token FlashMLA pages; D rank d reads its tokens from P rank d",
            _attention_pair(_deepseek, {"tp": 8, "kernel_block_tokens": 64},
                            {"tp": 8, "kernel_block_tokens": 64, "topology": Topology(dcp=8, interleave=64)}),
            default_layers=61, default_tokens=600,
        ),
        Preset(
            "deepseek-v3-dcp4-dcp2",
            "DeepSeek-V3-like MLA, 61 layers: P TP8 with DCP4 -> D TP8 with DCP2, token-level interleave "
            "(interleave 1), 64-token FlashMLA pages; each D token comes from the P DCP rank holding it",
            _attention_pair(_deepseek, {"tp": 8, "kernel_block_tokens": 64, "topology": Topology(dcp=4)},
                            {"tp": 8, "kernel_block_tokens": 64, "topology": Topology(dcp=2)}),
            default_layers=61, default_tokens=300,
        ),
        Preset(
            "kimi-linear-pp2tp4-tp1",
            "KimiLinear-like MLA + two KDA state groups on shared regions, 2 layers per group (6 global layers): "
            "P PP2 x TP4 1536/64 (ppl 24; stage 0 holds global layers 0-2) -> D TP1 5760/64 (ppl 90)",
            _hybrid_pair(_kimi, p_tp=4, d_tp=1, kernel=64, p_ppl=24, d_ppl=90, p_topology=Topology(pp=2)),
            default_layers=2, default_tokens=1000, hybrid=True,
        ),
        Preset(
            "unpairable-fp8",
            "Demo of a rejected pair: P caches bf16 (head_bytes 256), D caches fp8 (head_bytes 128); "
            "kvgeom plan exits with status 2 and the reasons",
            _attention_pair(lambda n: _llama("llama-3-8b-like", n), {"tp": 2, **_HND16}, {"tp": 2, **_HND16},
                            d_model=lambda n: _llama("llama-3-8b-like", n, head_bytes=128, dtype="fp8_e4m3")),
            default_layers=2, default_tokens=64, pairable=False,
        ),
    ]
    return {p.name: p for p in items}


PRESETS: dict[str, Preset] = _presets()
DEFAULT_PRESET = "gqa-tp2-tp4"


def get_preset(name: str) -> Preset:
    """The preset called ``name``; :class:`UnknownPreset` (a ``ValueError``) lists the valid names."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        names = sorted(PRESETS)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6) if isinstance(name, str) else []
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise UnknownPreset("preset", f"no preset named {value_text(name, 60)}", actual=name, expected=names,
                            fix=f"{hint}run `kvgeom presets` to list them") from None
