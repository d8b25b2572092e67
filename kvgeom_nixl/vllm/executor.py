"""The one adapter between the vLLM connector and kvgeom_nixl's executor (docs/design.md §15.4).

Every call the connector makes into :class:`~kvgeom_nixl.Endpoint` / :class:`~kvgeom_nixl.Link`
is here, so a change of the executor's API touches this class only. What it works around in
today's executor, each marked ``GAP`` below:

* **P serves a pull knowing only its own blocks.** ``Link.serve_pull`` needs the whole request
  (D's blocks too), which P never learns in vLLM. P therefore never calls it: D READs P's pages,
  and P frees the request's blocks on D's side-channel release (or on its lease), not on kvgeom's
  ``pulled`` notifications, which stay unclaimed in P's inbox until they expire (bounded).
* **A non-raising poll.** ``Transfer.poll`` raises ``TransferFailed``; :meth:`poll` reads each
  transfer's state instead and returns finished and failed ids, never raising for one request.
* **kv_both.** An ``Endpoint`` has one role, a vLLM instance both serves and pulls: two endpoints
  (two NIXL agents) register the same layer tensors, one ``prefill`` and one ``decode``.
* **One attempt, one id.** The executor wants a fresh id per attempt; the adapter makes it
  (``<request>#<n>``) and maps it back.

Threading: one adapter per worker rank, used from the worker's thread only (the executor states
no thread safety; nothing here starts a thread). Every wait is the connector's own step loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvgeom import EngineGeometry, Pair, Request, request_from_block_tables
from kvgeom_nixl.endpoint import Endpoint, Link
from kvgeom_nixl.errors import TransferFailed
from kvgeom_nixl.transfer import Transfer

__all__ = ["ConnectorExecutor", "PullOutcome"]

DEFAULT_PULL_TIMEOUT_S = 60.0


class PullOutcome:
    """A settled pull: ``ok``, and the failure's reason when not."""

    __slots__ = ("request_id", "ok", "reason", "invalid_blocks")

    def __init__(self, request_id: str, ok: bool, reason: str = "",
                 invalid_blocks: dict[int, tuple[int, ...]] | None = None) -> None:
        self.request_id, self.ok, self.reason = request_id, ok, reason
        self.invalid_blocks = invalid_blocks or {}  # group -> D blocks the failed pull may have written


class ConnectorExecutor:
    """One worker rank's executor: registration, handshake, links per remote engine, pulls, poll."""

    def __init__(self, engine: EngineGeometry, rank: int, tensors: Sequence[Any], *,
                 timeout_s: float = DEFAULT_PULL_TIMEOUT_S) -> None:
        # GAP kv_both: one endpoint per role over the same tensors (regions in the geometry's order).
        self.prefill = Endpoint(engine, "prefill", rank, tensors)
        self.decode = Endpoint(engine, "decode", rank, tensors)
        self.timeout_s = timeout_s
        self._links: dict[str, Link] = {}
        self._pulls: dict[str, tuple[str, Transfer]] = {}  # attempt id -> (request id, transfer)
        self._attempts = itertools.count()

    def handshake(self) -> bytes:
        """What this rank serves to a D rank: its prefill endpoint's payload."""
        return self.prefill.handshake()

    def link(self, engine_id: str, payloads: Sequence[bytes]) -> Link:
        """The link to remote engine ``engine_id``, built (compiled pair, loaded metadata) once."""
        if engine_id not in self._links:
            self._links[engine_id] = self.decode.connect(payloads)
        return self._links[engine_id]

    def has_link(self, engine_id: str) -> bool:
        return engine_id in self._links

    @staticmethod
    def pair(link: Link) -> Pair:
        return link.pair

    @staticmethod
    def request(link: Link, computed_tokens: int, prefill_blocks: Sequence[Sequence[int]],
                decode_blocks: Sequence[Sequence[int]], prefix_hit_tokens: int) -> Request:
        """kvgeom's request from both sides' block tables (vLLM's null block 0 skipped in windows)."""
        return request_from_block_tables(link.pair, computed_tokens, prefill_blocks, decode_blocks,
                                         prefix_hit_tokens=prefix_hit_tokens, null_block=0)

    def pull(self, link: Link, request_id: str, request: Request) -> None:
        """Post this rank's READs for ``request``; its outcome comes from :meth:`poll`."""
        attempt = f"{request_id}#{next(self._attempts)}"  # GAP: a fresh id per attempt, made here
        # strategy "direct": auto may choose staged, whose receive-side rearranges move token rows by
        # kvgeom's page model, which is not CPU_ATTN's inside the K plane (docs/design.md §15.3).
        self._pulls[attempt] = (request_id, link.pull(attempt, request, timeout_s=self.timeout_s, strategy="direct"))

    def poll(self) -> list[PullOutcome]:
        """Advance both endpoints; the pulls that settled since the last call (never raises for one)."""
        self.prefill.progress()  # GAP: P keeps its agent draining while D reads (UCX TCP needs it)
        self.decode.progress()
        out = []
        for attempt, (rid, t) in list(self._pulls.items()):
            if not t.settled:  # a transfer past its deadline is failed by its own advance()
                continue
            failure: TransferFailed | None = t.failure
            if failure is None:
                out.append(PullOutcome(rid, t.done))
            else:
                out.append(PullOutcome(rid, False, f"{failure.reason}: {failure}", failure.invalid_blocks))
            del self._pulls[attempt]
        return out

    def in_flight(self) -> int:
        return len(self._pulls)

    def close(self) -> None:
        for _, t in self._pulls.values():
            if not t.settled:
                t.cancel("closed", "connector shut down")
        self._pulls.clear()
        for link in self._links.values():
            link.close()
        self._links.clear()
        self.decode.close()
        self.prefill.close()
