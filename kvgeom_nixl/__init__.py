"""kvgeom_nixl: run kvgeom transfer plans with NIXL (torch + nixl; kvgeom itself never imports them).

    from kvgeom_nixl import Endpoint
    d = Endpoint(decode_geometry, "decode", rank, [kv_tensor_of_region_0, ...])
    link = d.connect([payload_from_each_prefill_rank])   # payload = prefill_endpoint.handshake()
    result = link.pull("req-1", request).wait(timeout_s=5)  # READs, receive steps, done

The executor never computes geometry: copies, zeros and rearranges come from the plan
(:func:`kvgeom.planning.plan_pair`), the tile tables from :mod:`kvgeom.lowering.tiles`.
"""

from __future__ import annotations

from .endpoint import DEFAULT_TIMEOUT_S, Endpoint, Link, Transfer, TransferResult, wait_all
from .errors import ExecutorError, HandshakeError, RegistrationError, TransferFailed
from .handshake import HANDSHAKE_VERSION, RankInfo, decode_rank, encode_rank
from .lowering import MODES
from .memory import RankMemory, RegionMemory
from .receive import apply_rearranges, apply_receive_steps, apply_zeros

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Endpoint",
    "ExecutorError",
    "HANDSHAKE_VERSION",
    "HandshakeError",
    "Link",
    "MODES",
    "RankInfo",
    "RankMemory",
    "RegionMemory",
    "RegistrationError",
    "Transfer",
    "TransferFailed",
    "TransferResult",
    "apply_rearranges",
    "apply_receive_steps",
    "apply_zeros",
    "decode_rank",
    "encode_rank",
    "wait_all",
]
