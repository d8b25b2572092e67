"""One attempt of one request on one rank: a state machine with a deadline and a fence (docs/design.md §8.1).

    posted ----------------> landed ---------------> receiving ------------> done  (result)
      the protocol's messages   D rank: rearranges,      the CUDA event has
      and NIXL requests done    then zeros (torch)       fired (CPU: at once)

    any state --(NIXL error, dead peer, peer's cancel, bad plan, torch error, deadline)--> failed
      -> fenced once no NIXL request of the attempt is in progress and no peer may still touch
         this rank's memory for it (its "ended", its completion message, its death or removal)

Every attempt draws a fresh nonce; every message it sends or accepts carries both sides' nonces
(:mod:`kvgeom_nixl.protocol`), so a message of another attempt (late, replayed, of a failed or
cancelled one, of the same request id) is dropped and counted. The direct protocols:

    pull (D)                                   serve_pull / hold (P)
      req(consumers) ------------------------>   (held for the id: P's blocks stay as they are)
                     <------------------------   grant
      READ + NIXL notification "pulled" ------>   P still holds? -> held
                     <------------------------   held      (D: done; a late READ gets cancel instead)
      acked (D is done) ---------------------->   P: done for that D rank (P's end mirrors D's)

    eager pull (D)                             serve_pull / hold (P)
      READ + NIXL notification "read(consumers)" -->   P still holds? -> held (the req and the
                     <------------------------   held      grant skipped: one round trip less)
      acked ---------------------------------->   P: done for that D rank

    accept_push (D)                            push (P)
      req ------------------------------------>   WRITE + NIXL notification "pushed"
          <-----------------------------------   (after the data)
      receive steps, done; acked ------------->   done (P knows D's attempt took the bytes)

An eager pull (``Link.pull(..., eager=True)``, direct plans) READs in its first ``advance``, with
no ``req``: P's ``held``, sent
once the READ's notification arrived while P still held its blocks, is what makes the bytes count,
as in the pull above. P's blocks cannot change while P holds them, a hold only ever ends, and it
began before D could know P's block ids; so blocks still held when the READ's notification (sent
after the data) arrives were held for the whole READ. A READ of blocks P no longer holds gets
``cancel`` and fails (its D blocks invalid); it never completes. What the grant adds is that D
never reads blocks P has already let go, and that a P that hangs before granting leaves no READ in
progress: an eager READ to a hung P can stay in progress past D's deadline, and D's attempt stays
fencing (its blocks not reusable) until NIXL ends it (design §8.1, §15.4). D repeats ``read`` as a plain message
every ``resend_s`` once its READs are DONE and a P rank has not confirmed (never before the data:
P would confirm bytes not yet moved).

A transfer never blocks and never polls on its own: :meth:`Transfer.advance` takes one step and is
called by its endpoint's ``progress()`` (which first routes the arrived messages to it);
:meth:`Transfer.poll` and :func:`wait_all` call ``progress()`` on the endpoints they are given.
On failure a D rank reports as invalid the D blocks the transfer may have written (the request's
writable blocks, docs/design.md §8); those are free to reuse once :attr:`Transfer.fenced`.

A D rank that gives up (its ``cancel``) ends every P attempt serving it as failed (``aborted``),
whatever P had seen of it; a P attempt is done only once each of its D ranks said it is done
(``acked``): P's outcome mirrors D's, never "done" for a pull D did not complete (docs/design.md §8.1).

Worked number: a pull on a D rank that reads from P ranks 0 and 1 sends 2 ``req``; after the two
``grant`` it is ``posted`` with 2 handles; after both DONE and both ``held`` it is ``landed``, and
``done`` within the same ``advance`` call when it has no rearranges or zeros: one notification
round trip before the READ and one message after it more than the READ alone (``acked`` follows
D's done, off D's path).
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
from .protocol import Message, new_nonce

__all__ = ["Transfer", "TransferResult", "wait_all", "Driver", "ReceiveSteps", "Poster", "DIRECT_KINDS"]

logger = logging.getLogger(__name__)

ReceiveSteps = Callable[[Sequence[Rearrange], Zeros], Any]
"""Runs a D rank's rearranges and zeros on its regions; returns a CUDA event, or ``None`` when done."""
Poster = Callable[[bytes], tuple[Any, int, int]]
"""Posts one NIXL request to one peer with the given notification: (handle, descriptors, bytes)."""
DIRECT_KINDS = ("pull", "push", "accept_push", "serve_pull", "hold")


class Driver(Protocol):
    """What drives a transfer: its endpoint (``progress`` routes messages, advances transfers)."""

    def progress(self) -> None: ...


class Messenger(Driver, Protocol):
    """What a transfer needs from its endpoint besides progress: signed messages to its peers."""

    @property
    def lock(self) -> Any: ...

    def say(self, t: Transfer, agent: str, kind: str, *args: int) -> bool: ...

    def signed(self, t: Transfer, agent: str, kind: str, *args: int) -> bytes: ...

    def count(self, what: str) -> None: ...

    def collected(self, t: Transfer) -> None: ...


@attrs.frozen
class TransferResult:
    """What one rank did for one request.

    ``descriptors``: descriptors handed to NIXL (mode coalesced: plan copies; mode prepped: index
    pairs; packed plans: wire rows); ``nixl_descs``: NIXL's own count after merging (telemetry;
    ``None`` unless the endpoint was made with ``telemetry=True``). ``notes``: e.g. ``NoteKind.PREPPED_FALLBACK``
    when mode prepped was asked for and coalesced lists were posted.
    """

    request_id: str
    kind: str  # pull | push | accept_push | serve_pull | hold
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
    """One attempt of one request on one rank: poll it (non-blocking) or wait for it (bounded).

    Made by a :class:`~kvgeom_nixl.Link`: ``endpoint`` drives it and signs its messages, ``agent``
    holds its NIXL requests; ``peers`` maps the peer agents it talks to onto their ranks;
    ``posters`` (pull, push) post the NIXL request to each peer once the protocol allows it;
    ``receive`` (D ranks only) runs the receive steps once the bytes have landed. ``consumers``
    (pull) tells each P agent how many D ranks read from it; ``expect_count`` (hold) is how many
    D ranks must confirm before a hold is done (``None``: as the D ranks say).
    """

    direct = True  # packed plans fence per staging slot instead

    def __init__(self, endpoint: Messenger, agent: RankAgent, kind: str, request_id: str, request: Request | None,
                 plan: TransferPlan | None, mode: str, timeout_s: float, *, role: str, rank: int,
                 peers: Mapping[str, int] | None = None, posters: Mapping[str, Poster] | None = None,
                 consumers: Mapping[str, int] | None = None, expect_count: int | None = None,
                 receive: ReceiveSteps | None = None, bytes_moved: int = 0, started: float | None = None,
                 invalid_blocks: Mapping[int, tuple[int, ...]] | None = None, resend_s: float = 5.0,
                 eager: bool = False) -> None:
        self.endpoint = endpoint
        self.eager = eager and kind == "pull" and self.direct  # READ at once, no req/grant (module docstring)
        self.agent = agent
        self.kind = kind
        self.request_id = request_id
        self.request = request
        self.plan = plan
        self.mode = mode
        self.role = role
        self.rank = rank
        self.on_decode = role == "decode"
        self.nonce = new_nonce()
        self.started = time.perf_counter() if started is None else started  # before planning, when the link planned
        self.deadline = self.started + timeout_s
        self.invalid_blocks = dict(invalid_blocks or {})  # D blocks this transfer may write (docs/design.md §8)
        self.timeout_s = timeout_s
        self.state = "posted"
        self.handles: list[Any] = []  # NIXL requests not yet reaped (after a failure: still in progress)
        self.peers: dict[str, int] = dict(peers or {})  # peer agent -> rank
        self.peer_nonce: dict[str, int] = {}  # the peer attempt each peer agent answered with
        self.contacted: set[str] = set()  # peers that know of this attempt (told of a failure)
        self.touching: set[str] = set()  # peers that may still write or read this rank's memory for it
        self.posters: dict[str, Poster] = dict(posters or {})
        self.consumers = dict(consumers or {})
        self.expect_count = expect_count
        self.granted: set[str] = set()  # hold: D ranks told they may READ; pull: P ranks that granted
        self.confirmed: set[str] = set()  # held (pull), pulled (hold), pushed (accept), acked (push)
        self.acked: set[str] = set()  # serve_pull / hold: D ranks that said their pull is done
        self.receive = receive
        self.event: Any = None
        self.failure: TransferFailed | None = None
        self.result: TransferResult | None = None
        self.bytes_moved = bytes_moved
        self.descriptors = 0
        self.nixl_requests = 0
        self.nixl_descs: int | None = 0 if agent.telemetry else None
        self.notes: list[Note] = []
        self.resend_s = resend_s
        self._ended_sent = False
        self._last_cancel = 0.0
        self._last_req = 0.0  # a direct pull repeats its req to the P ranks that have not granted yet
        self._collected = False
        self._decode_part: TransferPlan | None = None  # plan.for_decode_rank(rank), computed once

    # ---- public ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def settled(self) -> bool:
        return self.state in ("done", "failed")

    @property
    def fenced(self) -> bool:
        """Settled, and nothing (no NIXL request of this attempt, no peer) may still touch the memory it
        used: a failed D transfer's ``invalid_blocks`` and every staging slot may be reused."""
        return self.settled and not self.handles and not self.touching and self._slots_fenced()

    def poll(self) -> bool:
        """Advance; True once done. Raises :class:`TransferFailed` if the request failed."""
        self.endpoint.progress()
        if self.failure is not None:
            self._collect()
            raise self.failure
        if self.done:
            self._collect()
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
        """Fail the transfer now (no-op once settled); its peers are told (``cancel``). Holds the
        endpoint's lock (any thread may cancel)."""
        with self.endpoint.lock:
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

    def start(self) -> None:
        """The attempt's first messages (a D rank's ``req`` to every P rank it needs). An eager pull
        sends none: its first :meth:`advance` posts the READs (each with its ``read`` notification),
        so that NIXL is driven from the thread that progresses the endpoint, as for every other
        request (posting from another thread while it progressed contended for UCX's worker lock:
        1-4 ms of CPU per READ in a vLLM worker, where the progress thread posts in 0.2 ms)."""
        if self.settled or not self.on_decode:
            return
        if self.eager:
            self.contacted.update(self.peers)
            self.granted.update(self.peers)  # (nothing to wait for before the READ)
            self._last_req = time.perf_counter()
            return
        try:
            for a in self.peers:
                self.contacted.add(a)
                if self.kind == "accept_push" and self.direct:
                    self.touching.add(a)  # from now on that P rank may WRITE into this rank's blocks
                if not self._say(a, "req", self.consumers.get(a, 0)):
                    self.fail("peer_disconnected", f"peer {a} is gone (NIXL refused the request's first message)")
                    return
            self._last_req = time.perf_counter()
        except nixl_errors() as e:
            self.fail(classify(e), f"sending req: {type(e).__name__}: {e}")

    def _post_eager(self) -> None:
        """An eager pull's READs, each with its ``read`` (the first :meth:`advance`; errors fail it there)."""
        for a in sorted(self.posters):
            self._post_to(a, "read", self.consumers.get(a, 0))

    def fail(self, reason: str, detail: str) -> None:
        """Settle as failed (no-op once settled): tell the peers, keep what NIXL still has in progress
        (released once it finishes, :meth:`advance_fence`), release the rest."""
        if self.settled:
            return
        self.state = "failed"
        blocks = self.invalid_blocks if self.role == "decode" else {}
        self.failure = TransferFailed(self.request_id, reason, detail, invalid_blocks=blocks, kind=self.kind,
                                      role=self.role, rank=self.rank)
        logger.warning("%s %r on %s rank %d failed (%s): %s", self.kind, self.request_id, self.role, self.rank,
                       reason, detail)
        self._on_fail()
        self._reap_settled(force=self.agent.closed)
        self._cancel_peers()
        self.advance_fence()

    def _cancel_peers(self) -> None:
        self._last_cancel = time.perf_counter()
        for a in sorted(self.contacted | self.touching):
            self._tell(a, "cancel")

    def _tell(self, agent: str, kind: str) -> None:
        """Best effort (a failure's messages): a peer NIXL cannot reach is told nothing."""
        try:
            self._say(agent, kind)
        except nixl_errors():
            pass
        except Exception:  # noqa: BLE001,S110 - the agent may be closed already
            pass

    def peer_gone(self, agent: str, reason: str, detail: str) -> None:
        """The peer died or was removed: it can touch nothing any more; a live attempt fails."""
        if agent not in self.peers:
            return
        self.touching.discard(agent)
        self.contacted.discard(agent)
        self._peer_over(agent)
        if not self.settled:
            self.fail(reason, detail)

    def watched(self) -> set[str]:
        """The peers whose death this attempt must learn of (every peer while live, then those it fences on)."""
        return set(self.peers) if not self.settled else set(self.touching)

    def advance_fence(self) -> None:
        """After a failure: release the NIXL requests that finished; once fenced, tell the peers
        (``ended``); while a peer is still awaited, repeat the ``cancel`` every ``resend_s``."""
        if self.state != "failed":
            return
        self._reap_settled(force=self.agent.closed)
        self._advance_slots()
        if self.fenced:
            if not self._ended_sent:
                self._ended_sent = True
                for a in sorted(self.contacted):
                    self._tell(a, "ended")
            return
        if self.touching and time.perf_counter() - self._last_cancel > self.resend_s:
            logger.warning("%s %r on %s rank %d: still fenced on %s", self.kind, self.request_id, self.role,
                           self.rank, sorted(self.touching))
            self._cancel_peers()

    def expired(self) -> bool:
        """The deadline has passed (it counts from before planning when the link planned)."""
        return time.perf_counter() > self.deadline

    def on_message(self, m: Message) -> None:
        """A verified message routed to this attempt; one of another attempt is dropped and counted."""
        a = m.sender
        mine, theirs = (m.d_nonce, m.p_nonce) if self.on_decode else (m.p_nonce, m.d_nonce)
        if a not in self.peers or (mine != self.nonce and not (mine == 0 and m.kind in ("req", "read", "cancel"))):
            self.endpoint.count("stale")
            return
        known = self.peer_nonce.get(a)
        if known is None:
            if theirs:
                self.peer_nonce[a] = theirs
        elif theirs != known:
            self.endpoint.count("stale")
            return
        if not self.on_decode:
            self.contacted.add(a)
        if m.kind == "ended":
            self.touching.discard(a)
            self._peer_over(a)
            if not self.settled:
                self.fail("aborted", f"peer {a} ended its attempt")
            return
        if m.kind == "cancel":  # the peer gave up: so does this attempt (a serve is never done for it)
            if not self.settled:
                self.fail("aborted", f"peer {a} gave up on the request")
            return
        try:
            if self.settled:
                self._late(m)
            else:
                self._on(m)
        except nixl_errors() as e:
            self.fail(classify(e), f"{type(e).__name__}: {e}")
        except KvGeomError as e:
            self.fail("plan_error", f"{type(e).__name__}: {e}")
        except RuntimeError as e:  # NIXL refused to post a request
            self.fail("nixl_error", f"{type(e).__name__}: {e}")

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
            self.fail("timeout", f"no completion after {self.timeout_s:.3g} s (waiting for {self._waiting_for()})")

    # ---- the direct protocols (packed plans override these) --------------------------------
    def _on(self, m: Message) -> None:
        a, k = m.sender, m.kind
        if self.kind == "pull" and k == "grant" and a not in self.granted:
            self.granted.add(a)
            self._post_to(a, "pulled")
        elif self.kind == "pull" and k == "held" and a in self.granted:
            self.confirmed.add(a)
        elif self.kind in ("serve_pull", "hold") and k == "req":
            self._on_req(a, m.args[0])
        elif self.kind in ("serve_pull", "hold") and k == "read":  # an eager READ's notification (or its repeat)
            if a in self.granted or self._consumers_agree(a, m.args[0]):
                self.granted.add(a)
                self.confirmed.add(a)
                self._say(a, "held")
        elif self.kind in ("serve_pull", "hold") and k == "pulled" and a in self.granted:
            self.confirmed.add(a)
            self._say(a, "held")
        elif self.kind in ("serve_pull", "hold") and k == "acked" and a in self.confirmed:
            self.acked.add(a)
        elif self.kind == "accept_push" and k == "pushed":
            self.confirmed.add(a)
            self.touching.discard(a)
        elif self.kind == "push" and k == "req" and a not in self.granted:
            self.granted.add(a)
            self._post_to(a, "pushed")
        elif self.kind == "push" and k == "acked" and a in self.granted:
            self.confirmed.add(a)
        else:
            self.endpoint.count("stale")

    def _on_req(self, a: str, consumers: int) -> None:
        if self._consumers_agree(a, consumers):
            self.granted.add(a)
            self._say(a, "grant")

    def _consumers_agree(self, a: str, consumers: int) -> bool:
        """P: D rank ``a`` says ``consumers`` D ranks read from this rank (0: it does not know);
        the first such count is kept, one that exceeds the link or differs fails this attempt."""
        if consumers:
            if consumers > len(self.peers):
                self.fail("plan_error", f"D rank {a} says {consumers} D ranks read from this rank, the link has "
                          f"{len(self.peers)}")
                return False
            if self.expect_count is None:
                self.expect_count = consumers
            elif consumers != self.expect_count:
                self.fail("plan_error", f"D rank {a} says {consumers} D ranks read from this rank, the plan says "
                          f"{self.expect_count}")
                return False
        return True

    def _late(self, m: Message) -> None:
        """A message for this attempt after it settled: what clears a fence (packed plans: per chunk)."""
        if self.kind == "accept_push" and m.kind == "pushed":
            self.touching.discard(m.sender)
        elif self.kind in ("serve_pull", "hold") and m.kind in ("pulled", "read"):
            self._tell(m.sender, "cancel")  # a READ after this attempt ended: D must not call it done

    def _post_to(self, a: str, notif_kind: str, *args: int) -> None:
        poster = self.posters.pop(a, None)
        if poster is None:
            return
        handle, descriptors, nbytes = poster(self.endpoint.signed(self, a, notif_kind, *args))
        self.add_request(handle, descriptors=descriptors, nbytes=nbytes)

    def _waiting_for(self) -> str:
        if self.handles:
            return "NIXL requests"
        if self.kind == "pull":
            return "P's grant" if len(self.granted) < len(self.peers) else "P's confirmation (held)"
        if self.kind in ("serve_pull", "hold"):
            return "D's READ (pulled)" if len(self.confirmed) > len(self.acked) or not self.confirmed \
                else "D's acknowledgement (acked)"
        if self.kind == "push":
            return "D's req" if len(self.granted) < len(self.peers) else "D's acknowledgement"
        return "notifications"

    def _step(self) -> None:
        if self.state == "posted":
            if self.eager and self.posters:
                self._post_eager()
            self._repeat_req()
            self._check_posted()
        if self.state == "landed":
            if self.receive is not None and self.plan is not None:
                steps = self.decode_part()
                self.event = self.receive(steps.rearranges, steps.zeros)
            self.state = "receiving"
        if self.state == "receiving":
            if self.event is not None and not self.event.query():
                return
            self.event = None
            self._finish()

    def _repeat_req(self) -> None:
        """A direct pull not yet granted by every P rank repeats its ``req`` to those ranks every
        ``resend_s``: a req P dropped (it came before P's link to this rank existed, so its key was
        unknown: ``unknown_sender``) is then kept once P knows this rank, and P's hold grants it.
        P answers a repeated req of an attempt it granted with ``grant`` again, which D ignores. An
        eager pull repeats its ``read`` instead, once its READs are DONE, to the P ranks that have not
        said ``held``; P answers ``held`` again."""
        if self.kind != "pull" or not self.direct or time.perf_counter() - self._last_req < self.resend_s:
            return
        if self.eager:  # the READ's notification again, only once every READ is DONE (never before the data)
            kind, waiting = "read", ([] if self.handles or self.posters else
                                     sorted(a for a in self.peers if a not in self.confirmed))
        else:
            kind, waiting = "req", sorted(a for a in self.peers if a not in self.granted)
        if not waiting:
            return
        self._last_req = time.perf_counter()
        try:
            for a in waiting:
                self._say(a, kind, self.consumers.get(a, 0))
        except nixl_errors() as e:
            self.fail(classify(e), f"repeating req: {type(e).__name__}: {e}")

    def decode_part(self) -> TransferPlan:
        """This D rank's part of the plan (``plan.for_decode_rank(rank)``), computed once."""
        if self._decode_part is None:
            if self.plan is None:
                raise ExecutorError("plan", f"{self.kind} {self.request_id!r} has no plan", fix="pass a plan")
            self._decode_part = self.plan.for_decode_rank(self.rank)
        return self._decode_part

    def _reap(self, handles: list[Any], what: str) -> list[Any]:
        """Release the finished requests among ``handles`` (counting NIXL's descriptors when
        telemetry is on) and return those still in flight; an error state raises (``fail()`` keeps
        what is left until NIXL reports it finished)."""
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
        """posted -> landed once the protocol's messages arrived and every NIXL request is DONE."""
        self.handles = self._reap(self.handles, "a request")
        if self.handles or self.posters:
            return
        k, n = self.kind, len(self.peers)
        if k in ("pull", "accept_push", "push"):
            ready = len(self.confirmed) == n and (k != "pull" or len(self.granted) == n)
        elif k == "serve_pull":  # every consumer READ under the hold and said it is done
            ready = len(self.acked) == n
        else:  # hold: as many D ranks as they (or the caller) say
            ready = self.expect_count is not None and len(self.acked) >= self.expect_count
        if ready:
            self.state = "landed"

    def _finish(self) -> None:
        zeroed = rearranges = 0
        if self.receive is not None and self.plan is not None:
            steps = self.decode_part()
            zeroed, rearranges = steps.bytes_zeroed, len(steps.rearranges)
        self.state = "done"
        if self.kind in ("accept_push", "pull"):  # D is done: its P ranks may end (push, serve_pull, hold)
            for a in self.peers:
                self._tell(a, "acked")
        self.result = TransferResult(self.request_id, self.kind, self.role, self.rank, self.mode, self.bytes_moved,
                                     self.descriptors, self.nixl_requests, self.nixl_descs, zeroed, rearranges,
                                     time.perf_counter() - self.started, tuple(self.notes))
        r = self.result
        logger.info("%s %r on %s rank %d done: %d B in %d descriptors (%d NIXL requests, mode %s), %d B zeroed, "
                    "%d rearranges, %.3f ms", r.kind, r.request_id, r.role, r.rank, r.bytes_moved, r.descriptors,
                    r.nixl_requests, r.mode, r.bytes_zeroed, r.rearranges, r.wall_s * 1e3)

    # ---- fencing helpers -------------------------------------------------------------------
    def _on_fail(self) -> None:
        """What may still touch this rank's memory after a failure (packed plans: per slot)."""
        self.posters.clear()
        if self.kind != "accept_push":
            self.touching.clear()  # only a push writes into this rank's memory from the peer's side

    def _peer_over(self, agent: str) -> None:
        """Hook: ``agent`` can touch nothing of this attempt any more (packed plans free its slots)."""

    def _slots_fenced(self) -> bool:
        return True

    def _advance_slots(self) -> None:
        """Hook: free the staging slots whose fence cleared (packed plans)."""

    def _reap_settled(self, force: bool = False) -> None:
        """Release every handle NIXL no longer reports in progress (``force``: all, the agent is gone)."""
        still = []
        for h in self.handles:
            try:
                busy = not force and self.agent.state(h) == "PROC"
            except Exception:  # noqa: BLE001 - an error state, or a handle NIXL cannot query: finished
                busy = False
            if busy:
                still.append(h)
                continue
            try:
                self.agent.release(h)
            except Exception as e:  # noqa: BLE001 - NIXL keeps an uncancellable handle in its leak list
                self.notes.append(Note(NoteKind.INFO, f"release failed: {type(e).__name__}"))
        self.handles = still

    def _say(self, agent: str, kind: str, *args: int) -> bool:
        return self.endpoint.say(self, agent, kind, *args)

    def _collect(self) -> None:
        if not self._collected:
            self._collected = True
            self.endpoint.collected(self)

    def __repr__(self) -> str:
        fence = "" if not self.settled or self.fenced else ", fencing"
        return f"Transfer({self.kind} {self.request_id!r} on {self.role} rank {self.rank}: {self.state}{fence})"


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
        t._collect()
    for t in transfers:
        if t.failure is not None:
            raise t.failure
    return [t.result for t in transfers if t.result is not None]
