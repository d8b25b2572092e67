"""The life of one request on one rank: a state machine with a deadline, advanced without blocking.

    posted ----------------> landed ---------------> receiving ------------> done  (result)
      every NIXL request DONE    D rank: rearranges,      the CUDA event has
      and every awaited          then zeros (torch;       fired (CPU: at once)
      notification arrived       P rank: nothing)

    any state --(NIXL error, dead peer, bad plan, torch error, deadline, cancel)--> failed (failure)
      every NIXL handle released, late notifications of this request id dropped

A transfer never blocks and never polls on its own: :meth:`Transfer.advance` takes one step and is
called by its endpoint's ``progress()`` (which first drains the agent's notifications);
:meth:`Transfer.poll` and :func:`wait_all` call ``progress()`` on the endpoints they are given.
The initiator (pull: D, push: P) holds the NIXL handles; the passive side (serve_pull: P,
accept_push: D) holds only the set of peer agents whose notification it still awaits. On
failure a D rank reports as invalid the D blocks the transfer may have written (the request's
writable blocks: its listed blocks minus the held prefix, docs/design.md §8).

Worked number: a pull on a D rank that reads from P ranks 0 and 1 is ``posted`` with 2 handles;
one DONE leaves 1; the second DONE makes it ``landed``; with no rearranges and no zeros it goes
``receiving`` -> ``done`` within the same ``advance`` call. Posted at t = 0 with ``timeout_s=5``,
a request still PROC at t = 5.001 s fails with reason ``timeout`` (waiting for NIXL requests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from kvgeom import InternalError, KvGeomError, Note, NoteKind, Rearrange, Request, TransferPlan, Zeros
from kvgeom.values import check_seconds

from .agent import RankAgent, classify, nixl_errors
from .errors import ExecutorError, TransferFailed

__all__ = ["Transfer", "TransferResult", "wait_all", "Driver", "ReceiveSteps"]

logger = logging.getLogger(__name__)

ReceiveSteps = Callable[[Sequence[Rearrange], Zeros], Any]
"""Runs a D rank's rearranges and zeros on its regions; returns a CUDA event, or ``None`` when done."""


class Driver(Protocol):
    """What drives a transfer: its endpoint (``progress`` drains notifications, advances transfers)."""

    def progress(self) -> None: ...


@attrs.frozen
class TransferResult:
    """What one rank did for one request.

    ``descriptors``: descriptors handed to NIXL (mode coalesced: plan copies; mode prepped: index
    pairs; packed plans: wire rows); ``nixl_descs``: NIXL's own count after merging (telemetry;
    ``None`` unless the endpoint was made with ``telemetry=True``). ``notes``: e.g. ``NoteKind.PREPPED_FALLBACK``
    when mode prepped was asked for and coalesced lists were posted.
    """

    request_id: str
    kind: str  # pull | push | accept_push | serve_pull
    role: str
    rank: int
    mode: str
    bytes_moved: int
    descriptors: int
    nixl_requests: int
    nixl_descs: int | None
    bytes_zeroed: int
    rearranges: int
    wall_s: float
    notes: tuple[Note, ...] = ()
    pack_s: float = 0.0  # packed plans: seconds in pack steps (P), wire requests and unpack steps (D)
    wire_s: float = 0.0
    unpack_s: float = 0.0
    chunks: int = 0  # packed plans: chunks this rank took part in


class Transfer:
    """One request on one rank: poll it (non-blocking) or wait for it (bounded).

    Made by a :class:`~kvgeom_nixl.Link`: ``endpoint`` drives it, ``agent`` holds its NIXL
    requests and notifications; ``receive`` (D ranks only) runs the receive steps once the bytes
    have landed. Passive sides give ``notif_kind`` and the peer agents they ``expect`` it from.
    """

    def __init__(self, endpoint: Driver, agent: RankAgent, kind: str, request_id: str, request: Request | None,
                 plan: TransferPlan, mode: str, timeout_s: float, *, role: str, rank: int, notif_kind: str = "",
                 expect: Iterable[str] = (), receive: ReceiveSteps | None = None, bytes_moved: int = 0,
                 started: float | None = None, invalid_blocks: Mapping[int, tuple[int, ...]] | None = None) -> None:
        self.endpoint = endpoint
        self.agent = agent
        self.kind = kind
        self.request_id = request_id
        self.request = request
        self.plan = plan
        self.mode = mode
        self.role = role
        self.rank = rank
        self.started = time.perf_counter() if started is None else started  # before planning, when the link planned
        self.deadline = self.started + timeout_s
        self.invalid_blocks = dict(invalid_blocks or {})  # D blocks this transfer may write (docs/design.md §8)
        self.timeout_s = timeout_s
        self.state = "posted"
        self.handles: list[Any] = []  # NIXL requests still to complete
        self.notif_kind = notif_kind  # passive sides: the notification kind they wait for
        self.expect: set[str] = set(expect)  # peer agents whose notification is still awaited
        if notif_kind:
            agent.claim(notif_kind, request_id)  # kept in the inbox (never evicted) until this transfer drops it
        self.receive = receive
        self.event: Any = None
        self.failure: TransferFailed | None = None
        self.result: TransferResult | None = None
        self.bytes_moved = bytes_moved
        self.descriptors = 0
        self.nixl_requests = 0
        self.nixl_descs: int | None = 0 if agent.telemetry else None
        self.notes: list[Note] = []

    # ---- public ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def settled(self) -> bool:
        return self.state in ("done", "failed")

    def poll(self) -> bool:
        """Advance; True once done. Raises :class:`TransferFailed` if the request failed."""
        self.endpoint.progress()
        if self.failure is not None:
            raise self.failure
        return self.done

    def wait(self, timeout_s: float | None = None, *, peers: Iterable[Driver] = ()) -> TransferResult:
        """Poll until done (also progressing in-process ``peers``); raises :class:`TransferFailed`."""
        if timeout_s is not None:
            timeout_s = check_seconds("timeout_s", timeout_s, error=ExecutorError)
            self.deadline = min(self.deadline, time.perf_counter() + timeout_s)
        wait_all([self], peers=peers)
        if self.result is None:
            raise InternalError("wait_all raised unless every transfer is done")
        return self.result

    def cancel(self, reason: str = "closed", detail: str = "cancelled") -> None:
        """Fail the transfer now (no-op once settled), releasing its NIXL requests."""
        self.fail(reason, detail)

    # ---- what the link and the endpoint call -----------------------------------------------
    def add_request(self, handle: Any, *, descriptors: int, nbytes: int) -> None:
        """A posted NIXL request of this transfer (``descriptors`` handed to NIXL, ``nbytes`` moved)."""
        self.handles.append(handle)
        self.descriptors += descriptors
        self.nixl_requests += 1
        self.bytes_moved += nbytes

    def fall_back(self, mode: str, why: str) -> None:
        """Posted in ``mode`` instead of the mode asked for (recorded as a PREPPED_FALLBACK note)."""
        text = f"{self.mode} mode unavailable ({why}); posted {mode}"
        logger.warning("%s %r on %s rank %d: %s", self.kind, self.request_id, self.role, self.rank, text)
        self.notes.append(Note(NoteKind.PREPPED_FALLBACK, text))
        self.mode = mode

    def fail(self, reason: str, detail: str) -> None:
        """Settle as failed (no-op once settled): release every handle, drop this id's notifications."""
        if self.settled:
            return
        self._release()
        self.state = "failed"
        blocks = self.invalid_blocks if self.role == "decode" else {}
        self.failure = TransferFailed(self.request_id, reason, detail, invalid_blocks=blocks, kind=self.kind,
                                      role=self.role, rank=self.rank)
        logger.warning("%s %r on %s rank %d failed (%s): %s", self.kind, self.request_id, self.role, self.rank,
                       reason, detail)
        if self.notif_kind:  # a late notification of this attempt must not complete a retry: use a new id
            self.agent.drop(self.notif_kind, self.request_id)

    def expired(self) -> bool:
        """The deadline has passed (it counts from before planning when the link planned)."""
        return time.perf_counter() > self.deadline

    def advance(self) -> None:
        """One non-blocking step; never raises (failures are recorded)."""
        if self.settled:
            return
        try:
            self._step()
        except nixl_errors() as e:
            self.fail(classify(e), f"{type(e).__name__}: {e}")
            return
        except KvGeomError as e:
            self.fail("plan_error", f"{type(e).__name__}: {e}")
            return
        except InternalError as e:  # a kvgeom bug, not bad input: still release every handle, and say so
            logger.error("%s %r on %s rank %d: kvgeom internal error: %s", self.kind, self.request_id, self.role,
                         self.rank, e)
            self.fail("plan_error", f"kvgeom internal error: {e}")
            return
        except (RuntimeError, IndexError) as e:  # torch errors in the receive steps, NIXL "ERR" states
            self.fail("receive_error" if self.state != "posted" else "nixl_error", f"{type(e).__name__}: {e}")
            return
        if not self.settled and time.perf_counter() > self.deadline:
            what = "NIXL requests" if self.handles else "notifications" if self.expect else "receive steps"
            self.fail("timeout", f"no completion after {self.timeout_s:.3g} s (waiting for {what})")

    # ---- the states ------------------------------------------------------------------------
    def _step(self) -> None:
        if self.state == "posted":
            self._check_posted()
        if self.state == "landed":
            if self.receive is not None:
                steps = self.plan.for_decode_rank(self.rank)
                self.event = self.receive(steps.rearranges, steps.zeros)
            self.state = "receiving"
        if self.state == "receiving":
            if self.event is not None and not self.event.query():
                return
            self.event = None
            self._finish()

    def _reap(self, handles: list[Any], what: str) -> list[Any]:
        """Release the finished requests among ``handles`` (counting NIXL's descriptors when
        telemetry is on) and return those still in flight; an error state raises (``fail()``
        releases what is left: release is idempotent)."""
        still = []
        for h in handles:
            st = self.agent.state(h)
            if st == "DONE":
                if self.nixl_descs is not None:
                    self.nixl_descs += self.agent.descriptor_count(h)
                self.agent.release(h)
            elif st == "PROC":
                still.append(h)
            else:
                raise RuntimeError(f"NIXL reported {st} for {what}")
        return still

    def _check_posted(self) -> None:
        """posted -> landed once every NIXL request is DONE and every awaited notification arrived."""
        self.handles = self._reap(self.handles, "a request")
        if self.expect:
            self.expect -= self.agent.senders(self.notif_kind, self.request_id)
        if not self.handles and not self.expect:
            if self.notif_kind:
                self.agent.drop(self.notif_kind, self.request_id)
            self.state = "landed"

    def _finish(self) -> None:
        zeroed = rearranges = 0
        if self.receive is not None:
            steps = self.plan.for_decode_rank(self.rank)
            zeroed, rearranges = steps.bytes_zeroed, len(steps.rearranges)
        self.state = "done"
        self.result = TransferResult(self.request_id, self.kind, self.role, self.rank, self.mode, self.bytes_moved,
                                     self.descriptors, self.nixl_requests, self.nixl_descs, zeroed, rearranges,
                                     time.perf_counter() - self.started, tuple(self.notes))
        r = self.result
        logger.info("%s %r on %s rank %d done: %d B in %d descriptors (%d NIXL requests, mode %s), %d B zeroed, "
                    "%d rearranges, %.3f ms", r.kind, r.request_id, r.role, r.rank, r.bytes_moved, r.descriptors,
                    r.nixl_requests, r.mode, r.bytes_zeroed, r.rearranges, r.wall_s * 1e3)

    def _release(self) -> None:
        for h in self.handles:
            try:
                self.agent.release(h)
            except Exception as e:  # noqa: BLE001 - NIXL keeps an uncancellable handle in its leak list
                self.notes.append(Note(NoteKind.INFO, f"release failed: {type(e).__name__}"))
        self.handles = []

    def __repr__(self) -> str:
        return f"Transfer({self.kind} {self.request_id!r} on {self.role} rank {self.rank}: {self.state})"


def wait_all(transfers: Sequence[Transfer], *, peers: Iterable[Driver] = ()) -> list[TransferResult]:
    """Drive ``transfers`` (and in-process ``peers``) until each is done or failed, each within its
    own deadline; then return their results or raise the first :class:`TransferFailed`."""
    drivers: list[Driver] = []
    for d in [t.endpoint for t in transfers] + list(peers):
        if all(d is not e for e in drivers):
            drivers.append(d)
    spins = 0
    while True:
        for d in drivers:
            d.progress()
        if all(t.settled for t in transfers):
            break
        spins += 1
        if spins > 2000:  # after the first ~ms of tight polling, back off (another process may need the core)
            time.sleep(min(1e-3, 1e-5 * (spins - 2000)))
    for t in transfers:
        if t.failure is not None:
            raise t.failure
    return [t.result for t in transfers if t.result is not None]
