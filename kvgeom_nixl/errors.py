"""The executor's errors: bad input is a ``ValueError`` (kvgeom's family), a failed transfer is not.

    ExecutorError(KvGeomError, ValueError)   registration sizes, unknown modes, closed endpoints
      RegistrationError                       a buffer that does not match its region
      DuplicateRequest                        a request id already in flight on the endpoint
    HandshakeError(SchemaError)               a peer's payload is malformed or inconsistent
    TransferFailed(RuntimeError)              timeout, dead peer, NIXL error: the D blocks to recompute

Worked number: a pull that times out after 5 s raises
``TransferFailed: request 'r1' (pull on decode rank 0) failed: timeout: no completion after 5 s
(waiting for NIXL requests); invalidate D blocks {group 0: [2, 3]}`` and every NIXL handle of the
request has been released.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgeom import KvGeomError, SchemaError

__all__ = ["ExecutorError", "RegistrationError", "DuplicateRequest", "HandshakeError", "TransferFailed",
           "FAILURE_REASONS"]


class ExecutorError(KvGeomError):
    """The executor was used with input it cannot accept (a ``ValueError``)."""


class RegistrationError(ExecutorError):
    """A buffer handed to registration does not match its region (size, layout, device)."""


class DuplicateRequest(ExecutorError):
    """A transfer call named a request id that is already in flight on the endpoint (docs/design.md §8.1)."""


class HandshakeError(SchemaError):
    """A peer's handshake payload is malformed, truncated, of another version or inconsistent."""


FAILURE_REASONS = ("timeout", "peer_disconnected", "nixl_error", "plan_error", "receive_error", "closed", "aborted")


class TransferFailed(RuntimeError):
    """A request's transfer did not complete; its D blocks must not be presented as valid.

    ``invalid_blocks`` maps each group index (model order) to the D logical block ids (state
    groups: slot ids) the transfer may have written: the request's listed D blocks minus the
    prefix blocks D already held (wholly before S). A transfer never writes those, and they may
    be shared prefix-cache blocks, so they stay valid; the caller frees or recomputes the listed ones.
    """

    def __init__(self, request_id: str, reason: str, detail: str = "", *,
                 invalid_blocks: Mapping[int, tuple[int, ...]] | None = None,
                 kind: str = "", role: str = "", rank: int = -1) -> None:
        self.request_id = request_id
        self.reason = reason
        self.detail = detail
        self.invalid_blocks: dict[int, tuple[int, ...]] = dict(invalid_blocks or {})
        self.kind = kind
        self.role = role
        self.rank = rank
        where = f" ({kind} on {role} rank {rank})" if kind else ""
        text = f"request {request_id!r}{where} failed: {reason}"
        if detail:
            text += f": {detail}"
        if self.invalid_blocks:
            text += "; invalidate D blocks " + _blocks_text(self.invalid_blocks)
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.request_id, self.reason, self.detail, self.invalid_blocks, self.kind, self.role,
                           self.rank))


def _blocks_text(blocks: Mapping[int, tuple[int, ...]]) -> str:
    parts = []
    for g, ids in blocks.items():
        shown = ", ".join(str(i) for i in ids[:6]) + (f", ... ({len(ids)} blocks)" if len(ids) > 6 else "")
        parts.append(f"group {g}: [{shown}]")
    return "{" + "; ".join(parts) + "}"


def _rebuild(request_id: str, reason: str, detail: str, blocks: dict[int, tuple[int, ...]], kind: str, role: str,
             rank: int) -> TransferFailed:
    return TransferFailed(request_id, reason, detail, invalid_blocks=blocks, kind=kind, role=role, rank=rank)
