"""An engine's topology: pipeline stages over the global layers, decode context parallel token
shards inside each stage's TP group, and prefill context parallel replicas (docs/design.md §11).

    Topology(pp=2)                          two stages, vLLM's default layer partition
    Topology(pp=2, partition=(24, 40))      explicit layers per stage (VLLM_PP_LAYER_PARTITION)
    Topology(dcp=8, interleave=64)          tokens sharded over 8 TP ranks, 64 tokens per chunk
    Topology(replicas=2)                    two PCP replicas holding equal bytes

    flat rank = (stage * replicas + replica) * tp + tp_rank     (vLLM's [PP, PCP, TP] order)
    dcp rank = tp_rank % dcp; head group = tp_rank // dcp

Worked number: PP2 x TP4 with 2 replicas has ``2 * 2 * 4 = 16`` ranks; flat rank 13 is
``13 = (1 * 2 + 1) * 4 + 1``: stage 1, replica 1, tp rank 1.
"""

from __future__ import annotations

from typing import Any

import attrs

from .fields import as_tuple, check_int, pos_int

__all__ = ["Topology", "RankCoords"]


def _partition(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    out = as_tuple(value, "Topology.partition")
    for i, v in enumerate(out):
        check_int(f"Topology.partition[{i}]", v, minimum=1)
    return tuple(int(v) for v in out)


@attrs.frozen
class Topology:
    """Pipeline stages, DCP and replicas of one engine; the default is one stage, no DCP, one replica.

    ``partition`` gives the layers of each stage (like ``VLLM_PP_LAYER_PARTITION``); None uses
    vLLM's default rule (:func:`kvgeom.arith.shard.layer_partition`). ``dcp`` must divide the
    engine's ``tp`` and ``interleave`` its kernel page tokens; the engine checks both.
    """

    pp: int = attrs.field(default=1, validator=pos_int)
    partition: tuple[int, ...] | None = attrs.field(default=None, converter=_partition)
    dcp: int = attrs.field(default=1, validator=pos_int)
    interleave: int = attrs.field(default=1, validator=pos_int)
    replicas: int = attrs.field(default=1, validator=pos_int)

    @property
    def trivial(self) -> bool:
        """One stage, no DCP, one replica: the engine of docs/design.md §3.2."""
        return self.pp == 1 and self.dcp == 1 and self.replicas == 1

    def describe(self, tp: int) -> str:
        """``PP2xTP4``, ``TP8 DCP8/64``, ``TP4 x2 replicas``; ``TP4`` when trivial."""
        parts = [f"PP{self.pp}x" if self.pp > 1 else "", f"TP{tp}"]
        if self.dcp > 1:
            parts.append(f" DCP{self.dcp}" + (f"/{self.interleave}" if self.interleave > 1 else ""))
        if self.replicas > 1:
            parts.append(f" x{self.replicas} replicas")
        return "".join(parts)


@attrs.frozen
class RankCoords:
    """Where flat rank ``rank`` sits: its stage, replica and TP rank, and inside the TP group its
    DCP rank and head group (docs/design.md §11.1)."""

    rank: int
    stage: int
    replica: int
    tp_rank: int
    dcp_rank: int
    head_group: int
