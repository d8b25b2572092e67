"""Endpoints: one rank of one engine, its NIXL agent, and the loop that drives its transfers.

    Endpoint (one rank: a RankAgent + the registered regions, a lock, an inbox)
      .handshake() -> bytes ------------------------------------> peer's Endpoint.connect([...])
      .connect([payload of every peer rank]) -> Link (kvgeom_nixl.link: the Pair, built once per peer engine)
      .progress()        route arrived messages (inbox), advance every transfer, heartbeat, fences
      .get_finished()    the transfers that ended since the last call: done, or failed once fenced
      .close()           fail what is in flight, release every handle, deregister

    Link on a D rank                        Link on a P rank
      .pull(id, request)   READ  <-----------  (P learns from the notification)  .serve_pull(id, request) / .hold(id)
      .accept_push(id, request)  <-----------  WRITE + notification               .push(id, request)

One pull, top-down: :meth:`Link.pull <kvgeom_nixl.link.Link.pull>` plans (or takes the plan), makes
a :class:`Transfer`, lowers this rank's copies to one poster per P rank (:mod:`kvgeom_nixl.posting`:
coalesced descriptor lists or prepared-table indices) and hands the transfer to the endpoint
(:meth:`Endpoint.track`), which sends its first message. Then every :meth:`Endpoint.progress`
drains the agent's notifications, routes them (:mod:`kvgeom_nixl.inbox`) and advances each
in-flight transfer one step (:mod:`kvgeom_nixl.transfer`: posted -> landed -> receive steps ->
done, or failed -> fenced).

Every call is an attempt with its own nonce; its messages are signed with the link's key and
carry both sides' nonces (:mod:`kvgeom_nixl.protocol`, docs/design.md §8.1): a D rank opens with
``req``, a P rank answers (``grant`` for a direct pull, ``want`` for packed plans, a WRITE for a
direct push), and nothing is done until the other side has confirmed (``held``, ``acked``). A
message of another attempt is dropped and counted; an id already in flight on the endpoint is
refused (:class:`~kvgeom_nixl.errors.DuplicateRequest`); a retry with the same id after a failure
is safe. A failed transfer stays *fencing* until no NIXL request of it is in progress and no peer
may still touch its memory; :meth:`Endpoint.get_finished` reports a failure only then. A peer a
transfer waits on is pinged every :data:`HEARTBEAT_S`: NIXL refuses a send to a dead one.

Threading (:mod:`kvgeom_nixl.threads`): every public call of an endpoint, of its links and of its
transfers' ``cancel`` holds ``endpoint.lock`` (a ``threading.RLock``, or the lock given), so any
thread may call them; nothing polls in the background unless a :class:`~kvgeom_nixl.Progressor`
is started: every wait loop calls ``progress()`` on its own endpoint and on the in-process peers it
is given, and a connector calls :meth:`Endpoint.get_finished` once per step. The contract
(registration, handshake, failure and invalid blocks) is docs/design.md §8; every copy is checked
to stay in its regions before posting (docs/design.md §4.2 (invariant 1)).

Hostile peers (docs/design.md §14): ``connect`` refuses payloads beyond the endpoint's
:class:`~kvgeom_nixl.handshake.HandshakeLimits` and loads each peer's metadata in the prober first
(:mod:`kvgeom_nixl.probe`); the inbox is bounded.

Worked number: P TP2 -> D TP1 on 4 fresh blocks, HND, pull: D rank 0 posts 2 NIXL requests (one
per P rank); each P rank counts 1 consumer (``plan.consumers() == [1, 1]``). With pipeline stages,
DCP and replicas (docs/design.md §11) ranks are flat: a D rank connects to the handshakes of every
P rank of every stage and posts requests only to the P ranks its rows name.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvgeom import DEFAULT_BUDGET, EngineGeometry, Pair, PlanBudget, Rearrange, Zeros, value_text
from kvgeom.values import check_instance, check_int, check_seconds

from .agent import RankAgent, classify, nixl_errors
from .errors import DuplicateRequest, ExecutorError, HandshakeError, TransferFailed
from .handshake import DEFAULT_LIMITS, ROLES, HandshakeLimits, RankInfo, decode_rank, encode_rank
from .inbox import INBOX_MAX, INBOX_TTL_S, Inbox
from .link import DEFAULT_TIMEOUT_S, Link, check_timeout
from .lowering import MAX_TABLE_TILES
from .memory import RankMemory
from .packed import DEFAULT_GRACE_S
from .probe import ProbeRefused, prober
from .protocol import document_mac, document_signed, encode, forget_keys, link_key, new_secret
from .receive import apply_receive_steps
from .staging import DEFAULT_SLOTS, StagingBuffer, run_steps
from .threads import locked
from .transfer import Transfer, TransferResult, wait_all

__all__ = ["Endpoint", "Link", "Transfer", "TransferResult", "wait_all", "MAX_TABLE_TILES", "DEFAULT_TIMEOUT_S",
           "check_timeout", "Finished", "HEARTBEAT_S"]

HEARTBEAT_S = 0.1  # how often an endpoint pings the peers its transfers wait on (a dead one refuses the send)
MAX_FINISHED = 1 << 16  # settled transfers get_finished keeps for its next call at most


@attrs.frozen
class Finished:
    """What :meth:`Endpoint.get_finished` returns: the transfers that ended since the last call.

    ``done``: their results; ``failed``: their failures, each reported only once fenced (nothing
    may touch its blocks any more), with ``invalid_blocks`` (D ranks) to free or recompute."""

    done: tuple[TransferResult, ...] = ()
    failed: tuple[TransferFailed, ...] = ()

    @property
    def done_ids(self) -> set[str]:
        return {r.request_id for r in self.done}

    @property
    def failed_ids(self) -> set[str]:
        return {f.request_id for f in self.failed}

    def invalid_blocks(self) -> dict[int, set[int]]:
        """Per group, every D block a failed transfer may have written (the union over ``failed``)."""
        out: dict[int, set[int]] = {}
        for f in self.failed:
            for g, ids in f.invalid_blocks.items():
                out.setdefault(g, set()).update(ids)
        return out


class Endpoint:
    """One rank of one engine: a NIXL agent and the rank's regions, registered once.

    **Threading model.** An endpoint is safe to use from several threads: each public call of the
    endpoint (``handshake``, ``connect``, ``progress``, ``get_finished``, ``close``), of its links
    (``plan``, ``pull``, ``push``, ``serve_pull``, ``hold``, ``accept_push``, ``close``) and
    ``Transfer.cancel`` runs under :attr:`lock`, one ``threading.RLock`` per endpoint (pass
    ``lock=`` to share one among endpoints, e.g. the two of a kv_both instance). Nothing runs in
    the background by itself: a rank whose engine may idle while a peer reads it (P) needs a
    :class:`~kvgeom_nixl.Progressor` (a daemon thread calling :meth:`progress` every millisecond
    under the lock), or its own loop calling :meth:`progress` or :meth:`get_finished`. Reading a
    transfer's state (``settled``, ``done``, ``failure``) needs no lock.

    **One role.** An endpoint is a prefill or a decode rank. A vLLM ``kv_both`` instance, which
    serves some requests and pulls others, makes two endpoints over the same tensors (two NIXL
    agents registering the same memory, one lock): their staging rings must stay apart (one ring
    serving both roles can fill with D slots waiting on a peer's P slots while the peer's ring fills
    the same way: a deadlock the slot order of docs/design.md §8.1 cannot break), and so do their
    request ids and handshakes (a peer connects each role to the other's opposite role).

    ``warm_prober`` (default true) starts the process's metadata prober in the background now, so
    that the first :meth:`connect` does not wait most of a second for it (``benchmarks/connect.py``).

    ``regions`` are the caller's buffers in the geometry's region order: torch tensors (CPU ->
    DRAM, CUDA -> VRAM), numpy arrays, or ``(pointer, nbytes)`` (``mem_type``/``device`` then say
    where); or the :class:`kvgeom.LayerTensors` the geometry was read from
    (:func:`kvgeom_nixl.region_buffers`). They are kept referenced, never copied, until :meth:`close`. ``rank_agent`` is the
    :class:`~kvgeom_nixl.agent.RankAgent`; ``agent`` the bare NIXL agent (``None`` once closed).
    """

    def __init__(self, engine: EngineGeometry, role: str, rank: int, regions: Sequence[Any], *,
                 agent_name: str | None = None, mem_type: str | None = None, device: int | None = None,
                 telemetry: bool = False, progress_thread: bool = False, staging_bytes: int = 0,
                 staging_slots: int = DEFAULT_SLOTS, staging_grace_s: float = DEFAULT_GRACE_S,
                 limits: HandshakeLimits = DEFAULT_LIMITS, budget: PlanBudget = DEFAULT_BUDGET,
                 inbox_ttl_s: float = INBOX_TTL_S, inbox_max: int = INBOX_MAX, lock: Any = None,
                 warm_prober: bool = True) -> None:
        check_instance("engine", engine, EngineGeometry, error=ExecutorError)
        check_instance("limits", limits, HandshakeLimits, error=ExecutorError)
        check_instance("budget", budget, PlanBudget, error=ExecutorError)
        inbox_ttl_s = check_seconds("inbox_ttl_s", inbox_ttl_s, error=ExecutorError)
        inbox_max = check_int("inbox_max", inbox_max, minimum=0, error=ExecutorError)
        staging_bytes = check_int("staging_bytes", staging_bytes, minimum=0, error=ExecutorError)
        staging_grace_s = check_seconds("staging_grace_s", staging_grace_s, error=ExecutorError)
        if not isinstance(role, str) or role not in ROLES:
            raise ExecutorError("role", f"unknown role {value_text(role, 60)}", actual=role, expected=list(ROLES))
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < engine.num_ranks:
            what = f"tp={engine.tp}" if engine.topology.trivial else f"the engine's {engine.num_ranks} ranks"
            raise ExecutorError("rank", f"rank {value_text(rank, 60)} outside {what}", actual=value_text(rank, 60),
                                expected=f"0 <= rank < {engine.num_ranks}")
        if lock is not None and not (callable(getattr(lock, "acquire", None)) and hasattr(lock, "__enter__")):
            raise ExecutorError("lock", f"a {type(lock).__name__} is not a lock", actual=type(lock).__name__,
                                expected="threading.RLock()", fix="pass threading.RLock() (or omit lock=)")
        self.lock: Any = threading.RLock() if lock is None else lock  # every public call holds it
        self.engine = engine
        self.role = role
        self.rank = int(rank)
        self.limits = limits
        self.budget = budget
        self.memory = RankMemory(engine, regions, mem_type=mem_type, device=device, rank=self.rank)
        self.telemetry = telemetry
        self.name = agent_name or f"kvgeom-{role}-{rank}-{uuid.uuid4().hex[:12]}"
        self.closed = False
        self._links: list[Link] = []
        self._inflight: list[Transfer] = []
        self._fencing: list[Transfer] = []  # failed, waiting for NIXL or a peer to let go of their memory
        self._finished: deque[Transfer] = deque(maxlen=MAX_FINISHED)  # settled and fenced, for get_finished
        self._stream: Any = None
        self.secret = new_secret()  # in the handshake: keys every link's messages (docs/design.md §8.1)
        self.inbox = Inbox(self.name, role, inbox_ttl_s, inbox_max)
        self.dead: set[str] = set()  # peer agents NIXL refused a send to (disconnected)
        self._newly_dead: list[tuple[str, str, str]] = []
        self._deferred: list[Transfer] = []  # retries whose first messages wait for an earlier attempt's fence
        self._last_ping = 0.0
        # packed plans (docs/design.md §12.5): one staging ring on the cache's device, registered with the regions
        self.staging = StagingBuffer(self.memory, staging_bytes, staging_slots) if staging_bytes else None
        self.staging_grace_s = staging_grace_s
        descs = self.memory.descs()
        if self.staging is not None:
            descs = np.concatenate([descs, np.array([self.staging.desc()], np.uint64)])
        self.rank_agent = RankAgent(self.name, descs, self.memory.mem_type, telemetry=telemetry,
                                    progress_thread=progress_thread)
        if warm_prober:  # the first connect would otherwise wait for the prober process to start
            prober().warm_async()

    @property
    def agent(self) -> Any:
        """The bare NIXL agent (``None`` once closed)."""
        return self.rank_agent.nixl

    # ---- handshake -------------------------------------------------------------------------
    @locked
    def info(self) -> RankInfo:
        self._open()
        regions = tuple((r.addr, r.nbytes, r.device) for r in self.memory.regions)
        st = self.staging
        staging = None if st is None else (st.addr, st.nbytes, st.device_id, st.slot_bytes, st.slots)
        return RankInfo(self.engine, self.role, self.rank, self.name, self.memory.mem_type, regions,
                        self.rank_agent.metadata(), staging, self.secret)

    @locked
    def handshake(self) -> bytes:
        """This rank's payload for the peer engine's :meth:`connect`."""
        return encode_rank(self.info())

    @locked
    def connect(self, payloads: Iterable[bytes | str | RankInfo], *, probe: bool = True) -> Link:
        """Validate the peer engine's payloads (one per peer rank it will use), load their NIXL
        metadata and build the :class:`Pair` once. Raises :class:`HandshakeError` or
        :class:`~kvgeom.errors.IncompatibleGeometry` before anything is loaded.

        Every metadata blob is first loaded in the prober process (:mod:`kvgeom_nixl.probe`);
        ``probe=False`` skips that, for payloads this process made itself (``LocalDeployment``)."""
        self._open()
        payloads = list(payloads)
        if len(payloads) > self.limits.max_ranks:
            raise HandshakeError("payloads", f"{len(payloads)} peer payloads, beyond the configured maximum of "
                                 f"{self.limits.max_ranks} ranks", actual=len(payloads),
                                 expected=f"<= {self.limits.max_ranks}")
        infos = [p if isinstance(p, RankInfo) else decode_rank(p, limits=self.limits) for p in payloads]
        if not infos:
            raise HandshakeError("payloads", "no peer payloads given", expected="one per peer rank")
        other = "prefill" if self.role == "decode" else "decode"
        first = infos[0]
        peers: dict[int, RankInfo] = {}
        for i, info in enumerate(infos):
            if info.role != other:
                raise HandshakeError(f"payloads[{i}].role", f"a {self.role} rank connects to {other} ranks, "
                                     f"got {info.role}", actual=info.role, expected=other)
            if info.engine != first.engine:
                raise HandshakeError(f"payloads[{i}].engine", "peer ranks advertise different geometries",
                                     actual=info.engine.summary(), expected=first.engine.summary(),
                                     fix="every rank of an engine shares one geometry")
            if info.rank in peers:
                raise HandshakeError(f"payloads[{i}].rank", f"rank {info.rank} appears twice", actual=info.rank)
            peers[info.rank] = info
        pair = Pair(first.engine, self.engine) if self.role == "decode" else Pair(self.engine, first.engine)
        self._load(peers, probe)
        for info in peers.values():
            p_secret, d_secret = (info.secret, self.secret) if self.role == "decode" else (self.secret, info.secret)
            p_name, d_name = (info.agent, self.name) if self.role == "decode" else (self.name, info.agent)
            self.inbox.keys[info.agent] = link_key(p_secret, d_secret, p_name, d_name)
            self.dead.discard(info.agent)
        link = Link(self, peers, pair)
        self._links = [lk for lk in self._links if not lk.closed] + [link]
        return link

    def _load(self, peers: dict[int, RankInfo], probe: bool = True) -> None:
        """Load every peer's NIXL metadata, or none of it (a refusal unloads what was loaded).

        Every blob is probed in a scratch agent first (:meth:`RankAgent.probe`): a blob NIXL refuses, or
        one naming another agent than its payload, never reaches this endpoint's agent, which stays
        able to load the honest peer afterwards (docs/design.md §14)."""
        loaded: list[str] = []
        try:
            for info in peers.values():
                try:
                    name = self.rank_agent.probe(info.metadata) if probe else info.agent
                except ProbeRefused as e:
                    raise HandshakeError(f"payloads[rank {info.rank}].nixl_metadata", f"NIXL refused the metadata: {e}",
                                         fix="send the metadata get_agent_metadata() made, unmodified") from None
                if name != info.agent:
                    raise HandshakeError(f"payloads[rank {info.rank}].agent", f"the NIXL metadata is agent "
                                         f"{value_text(name, 80)}, the payload says {value_text(info.agent, 80)}",
                                         actual=name, expected=info.agent)
                loaded.append(self.rank_agent.add_peer(info.metadata))
                if loaded[-1] != info.agent:  # only without a probe: the blob named another agent
                    raise HandshakeError(f"payloads[rank {info.rank}].agent", f"the NIXL metadata is agent "
                                         f"{value_text(loaded[-1], 80)}, the payload says {value_text(info.agent, 80)}",
                                         actual=loaded[-1], expected=info.agent)
        except nixl_errors() as e:
            self._unload(loaded)
            raise HandshakeError("nixl_metadata", f"NIXL refused the metadata: {type(e).__name__}: {e}") from e
        except HandshakeError:
            self._unload(loaded)
            raise

    def _unload(self, names: list[str]) -> None:
        for n in names:
            self.rank_agent.remove_peer(n)

    # ---- transfers -------------------------------------------------------------------------
    @locked
    def track(self, transfer: Transfer) -> Transfer:
        """Register ``transfer`` (its nonce routes its messages), send its first messages and advance
        it in every :meth:`progress` until it settles and is fenced; returns it."""
        if transfer.settled:
            self._settled(transfer)
            return transfer
        if not transfer.on_decode:  # what already arrived first: a D attempt that asked and gave up before
            self.inbox.route(self.rank_agent.drain(), self._reply)  # this one was posted never binds to it
        self.inbox.add(transfer)
        if any(f.request_id == transfer.request_id for f in self._fencing):
            self._deferred.append(transfer)  # a retry waits for the failed attempt's fence (same blocks)
        else:
            transfer.start()
        self._inflight.append(transfer)
        return transfer

    def check_id(self, request_id: str, what: str) -> None:
        """Refuse an id already in flight on this endpoint (:class:`DuplicateRequest`)."""
        other = self.inbox.by_id.get(request_id)
        if other is not None and not other.settled:
            raise DuplicateRequest("request_id", f"{what}: request {value_text(request_id, 80)} is already in flight "
                                   f"on {self.name} ({other.kind})", actual=request_id,
                                   fix="wait for the first transfer (or cancel it), or use another id")

    @property
    def in_flight(self) -> tuple[Transfer, ...]:
        """The transfers of this rank not yet done or failed."""
        return tuple(t for t in self._inflight if not t.settled)

    @property
    def fencing(self) -> tuple[Transfer, ...]:
        """Failed transfers whose memory a NIXL request or a peer may still touch."""
        return tuple(self._fencing)

    @locked
    def progress(self) -> None:
        """Route the arrived messages and advance every transfer of this rank (non-blocking)."""
        if self.closed:
            return
        self.inbox.route(self.rank_agent.drain(), self._reply)
        if self.staging is not None:
            self.staging.serve_waiting()
        for t in list(self._inflight):
            t.advance()
        if self.staging is not None:
            self.staging.serve_waiting()
        self._heartbeat()
        self._bury()
        still = []
        for t in self._inflight:
            if t.settled:
                self._settled(t)
            else:
                still.append(t)
        self._inflight = still
        if self._fencing:
            for t in list(self._fencing):
                t.advance_fence()
            done = [t for t in self._fencing if t.fenced]
            if done:
                self._fencing = [t for t in self._fencing if not t.fenced]
                for t in done:
                    self.inbox.forget(t)
                    self._finished.append(t)
        if self._deferred:
            fencing = {f.request_id for f in self._fencing}
            ready = [t for t in self._deferred if t.request_id not in fencing or t.settled]
            self._deferred = [t for t in self._deferred if t not in ready]
            for t in ready:
                t.start()

    def _settled(self, t: Transfer) -> None:
        self.inbox.settle(t)
        if t.fenced:
            self.inbox.forget(t)
            self._finished.append(t)
        else:
            self._fencing.append(t)

    @locked
    def get_finished(self, *, progress: bool = True) -> Finished:
        """Progress once (unless ``progress=False``: a :class:`~kvgeom_nixl.Progressor` thread does),
        then every transfer that ended since the last call and that no wait or poll has reported yet:
        results, and failures once fenced (their ``invalid_blocks`` may be reused or recomputed).
        Never raises for a failed transfer: the connector loop's one call per step."""
        if progress:
            self.progress()
        done: list[TransferResult] = []
        failed: list[TransferFailed] = []
        while self._finished:
            t = self._finished.popleft()
            if t._collected:
                continue
            t._collected = True
            if t.result is not None:
                done.append(t.result)
            elif t.failure is not None:
                failed.append(t.failure)
        return Finished(tuple(done), tuple(failed))

    def collected(self, t: Transfer) -> None:
        """A wait or poll reported ``t``'s end: get_finished will not report it again."""

    def count(self, what: str) -> None:
        """Count a dropped message (``stale``: of another attempt)."""
        self.inbox.counts[what] += 1

    def signed(self, t: Transfer, agent: str, kind: str, *args: int) -> bytes:
        """``t``'s message of ``kind`` to peer ``agent``, with both nonces, signed with the link's key."""
        peer = t.peer_nonce.get(agent, 0)
        d, p = (t.nonce, peer) if self.role == "decode" else (peer, t.nonce)
        return encode(self.inbox.keys.get(agent, b""), self.name, agent, kind, t.request_id, d, p, *args)

    def sign_document(self, agent: str, request_id: str, document_sha256: bytes) -> str:
        """The MAC of a document (about ``request_id``, given its SHA-256) from this endpoint to peer
        ``agent``, under their link's key (:func:`kvgeom_nixl.protocol.document_mac`): for what
        crosses a channel of the caller's own, e.g. the vLLM connector's side channel."""
        key = self.inbox.keys.get(agent)
        if key is None:
            raise ExecutorError("agent", f"{agent[:80]!r} is not a connected peer of {self.name}",
                                fix="connect to the peer before signing for it")
        return document_mac(key, self.name, agent, request_id, document_sha256)

    def document_signed(self, agent: str, request_id: str, document_sha256: bytes, mac: str) -> bool:
        """Whether peer ``agent`` signed the document (about ``request_id``, given its SHA-256) for
        this endpoint (False for an agent that is not a connected peer, or a dead one)."""
        key = self.inbox.keys.get(agent)
        return key is not None and agent not in self.dead and document_signed(key, agent, self.name, request_id,
                                                                              document_sha256, mac)

    def say(self, t: Transfer, agent: str, kind: str, *args: int) -> bool:
        """Send ``t``'s message to ``agent``; False when the peer is gone (disconnected or removed; its
        transfers learn it in this progress call); any other NIXL error is raised."""
        if agent in self.dead or agent not in self.inbox.keys or self.closed:
            return False
        return self._send(agent, self.signed(t, agent, kind, *args), raising=True)

    def _reply(self, agent: str, kind: str, request_id: str, d_nonce: int, p_nonce: int) -> None:
        """The inbox's answer to a message of an attempt this rank no longer has."""
        key = self.inbox.keys.get(agent)
        if key is not None and agent not in self.dead:
            self._send(agent, encode(key, self.name, agent, kind, request_id, d_nonce, p_nonce))

    def _send(self, agent: str, message: bytes, raising: bool = False) -> bool:
        try:
            self.rank_agent.send(agent, message)
        except nixl_errors() as e:
            if classify(e) == "peer_disconnected":
                self._mark_dead(agent, "peer_disconnected", f"NIXL refused a notification: {type(e).__name__}")
            elif raising:
                raise
            return False
        return True

    def _mark_dead(self, agent: str, reason: str, detail: str) -> None:
        if agent not in self.dead:
            self.dead.add(agent)
            self._newly_dead.append((agent, reason, detail))

    def _bury(self) -> None:
        """Tell every transfer of the peers that died or were removed since the last call."""
        while self._newly_dead:
            agent, reason, detail = self._newly_dead.pop(0)
            for t in self._inflight + self._fencing:
                t.peer_gone(agent, reason, f"peer {agent}: {detail}")

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S, ping each peer a transfer waits on: NIXL refuses a send to a dead one
        within milliseconds, so a dead peer fails every mode's transfers in well under a second."""
        now = time.perf_counter()
        if now - self._last_ping < HEARTBEAT_S or not (self._inflight or self._fencing):
            return
        self._last_ping = now
        watched: set[str] = set()
        for t in self._inflight + self._fencing:
            watched |= t.watched()
        for agent in sorted(watched - self.dead):
            key = self.inbox.keys.get(agent)
            if key is not None:
                self._send(agent, encode(key, self.name, agent, "ping", "ping", 0, 0))

    @locked
    def peer_removed(self, agent: str) -> None:
        """A link forgot ``agent``: it can touch nothing any more; its transfers fail (``closed``)."""
        self.inbox.keys.pop(agent, None)
        forget_keys()  # (no HMAC state of the dropped key is kept)
        self._mark_dead(agent, "closed", "the link was closed (its agent removed)")
        self._bury()

    def pending_notifications(self) -> dict[tuple[str, str], set[str]]:
        """D ranks' messages no transfer has taken yet: (kind, request id) -> sender agents; kind
        ``req`` (a pull's or an accept_push's) or ``read`` (an eager pull's READ, already done)."""
        return self.inbox.pending_ids()

    def receive(self, rearranges: Sequence[Rearrange], zeros: Zeros) -> Any:
        """Run receive steps on this rank's regions (on :meth:`stream` for VRAM): a CUDA event to
        wait for, or ``None`` once done (host memory)."""
        return apply_receive_steps(self.memory.byte_views(), rearranges, zeros, stream=self.stream())

    def run_staged(self, steps: Sequence[Any], slot: int, pack: bool) -> Any:
        """Pack steps into (``pack``) or unpack steps out of staging ``slot`` on this rank's regions
        (on :meth:`stream` for VRAM): a CUDA event to wait for, or ``None`` once done."""
        if self.staging is None:
            raise ExecutorError("staging", "this endpoint has no staging buffer", fix="pass staging_bytes")
        stream = self.stream()
        if stream is None:
            run_steps(steps, self.memory.byte_views(), self.staging, slot, pack=pack)
            return None
        import torch

        with torch.cuda.stream(stream):
            run_steps(steps, self.memory.byte_views(), self.staging, slot, pack=pack)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def stream(self) -> Any:
        """The CUDA stream receive steps run on (``None`` for host memory)."""
        if self.memory.mem_type != "VRAM":
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self.memory.device())
        return self._stream

    # ---- teardown --------------------------------------------------------------------------
    def _open(self) -> None:
        if self.closed:
            raise ExecutorError("endpoint", f"endpoint {self.name} is closed", fix="make a new Endpoint")

    @locked
    def close(self) -> None:
        """Fail in-flight transfers, release every handle, deregister, drop the buffers."""
        if self.closed:
            return
        for t in list(self._inflight):
            t.cancel("closed", "endpoint closed")
        for link in self._links:
            link.close()
        self._links = []
        self.rank_agent.close()
        for t in self._inflight + self._fencing:
            t.advance_fence()  # the agent is gone: every handle is released
        self._inflight = []
        self._fencing = []
        self.inbox.clear()
        forget_keys()
        self.closed = True
        self.memory.release()
        self.staging = None

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        links = sum(not lk.closed for lk in self._links)
        state = "closed" if self.closed else f"{links} links, {len(self.in_flight)} in flight"
        return f"Endpoint({self.name}: {self.engine.name} {self.role} rank {self.rank}/{self.engine.num_ranks}, {state})"
