"""kvgeom_nixl: run kvgeom transfer plans with NIXL (torch + nixl; kvgeom itself never imports them).

    from kvgeom_nixl import Endpoint
    d = Endpoint(decode_geometry, "decode", rank, layers)  # the LayerTensors from_tensors read (or region buffers)
    link = d.connect([payload_from_each_prefill_rank])   # payload = prefill_endpoint.handshake()
    result = link.pull("req-1", request).wait(timeout_s=5)  # READs, receive steps, done

The executor never computes geometry: copies, zeros and rearranges come from the plan
(:func:`kvgeom.planning.plan_pair`), the tile tables and receive-step rows from
:mod:`kvgeom.lowering`; it imports only the public faces of kvgeom (docs/design.md §2, §8).

    endpoint   Endpoint: handshake, connect, progress, get_finished (one rank and its NIXL agent)
    link       Link: plan, pull / push / accept_push / serve_pull / hold (one peer engine, one request)
    posting    a rank's copies as NIXL requests (descriptor lists or prepared-table indices)
    transfer   Transfer: one attempt, posted -> landed -> receiving -> done | failed (-> fenced); wait_all
    threads    the threading model: one lock per endpoint; Progressor, a thread that calls progress()
    protocol   signed messages with both attempts' nonces     inbox   verify and route them, bounded
    agent      RankAgent: one rank's NIXL agent (the only module that imports NIXL)
    lowering   descriptors for the coalesced and prepped modes     receive    torch receive steps
    handshake  the versioned payload      memory    registrable regions      errors    typed errors

Logging: children of the ``kvgeom_nixl`` logger (info: one summary per finished transfer;
warning: failed transfers and the prepped -> coalesced fallback). Only a ``NullHandler`` is added.
"""

from __future__ import annotations

import logging

from kvgeom import MissingExtra as _MissingExtra
from kvgeom import install_hint as _install_hint

try:
    import torch  # noqa: F401 - receive steps, staging and registration views are torch
except ImportError as _missing:
    raise _MissingExtra("torch", "kvgeom_nixl needs torch, which is not installed", actual=str(_missing),
                       expected="torch (the nixl extra)",
                       fix=f"install your engine's torch, or {_install_hint('nixl')}") from _missing

from .endpoint import DEFAULT_TIMEOUT_S, Endpoint, Finished, Link
from .errors import DuplicateRequest, ExecutorError, HandshakeError, RegistrationError, TransferFailed
from .handshake import HANDSHAKE_VERSION, HandshakeLimits, RankInfo, decode_rank, encode_rank
from .lowering import MODES
from .memory import RankMemory, RegionMemory, region_buffers
from .receive import apply_rearranges, apply_receive_steps, apply_zeros
from .staging import staging_bytes_for
from .threads import Progressor
from .transfer import Transfer, TransferResult, wait_all

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DuplicateRequest",
    "Endpoint",
    "ExecutorError",
    "Finished",
    "HANDSHAKE_VERSION",
    "HandshakeError",
    "HandshakeLimits",
    "Link",
    "MODES",
    "Progressor",
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
    "region_buffers",
    "staging_bytes_for",
    "wait_all",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
