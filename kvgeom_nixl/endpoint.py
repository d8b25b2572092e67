"""Endpoints and links: one rank of one engine, and its connection to every rank of a peer engine.

    Endpoint (one rank: a RankAgent + the registered regions)
      .handshake() -> bytes ------------------------------------> peer's Endpoint.connect([...])
      .connect([payload of every peer rank]) -> Link (the Pair, built once per peer engine)

    Link on a D rank                        Link on a P rank
      .pull(id, request)   READ  <-----------  (P learns from the notification)  .serve_pull(id, request)
      .accept_push(id, request)  <-----------  WRITE + notification               .push(id, request)

One pull, top-down: ``Link.pull`` plans (or takes the plan), makes a :class:`Transfer`, lowers
this rank's copies to one NIXL request per P rank (:meth:`Link._post`: coalesced descriptor lists
or prepared-table indices, :mod:`kvgeom_nixl.lowering`), posts them through the endpoint's
:class:`~kvgeom_nixl.agent.RankAgent` and hands the transfer to the endpoint. Then every
:meth:`Endpoint.progress` drains the agent's notifications and advances each in-flight transfer
one step (:mod:`kvgeom_nixl.transfer`: posted -> landed -> receive steps -> done, or failed).

Every call is an attempt with its own nonce; its messages are signed with the link's key and
carry both sides' nonces (:mod:`kvgeom_nixl.protocol`, docs/design.md §8.1): a D rank opens with
``req``, a P rank answers (``grant`` for a direct pull, ``want`` for packed plans, a WRITE for a
direct push), and nothing is done until the other side has confirmed (``held``, ``acked``). A
message of another attempt is dropped and counted; an id already in flight on the endpoint is
refused (:class:`~kvgeom_nixl.errors.DuplicateRequest`); a retry with the same id after a failure
is safe. A failed transfer stays *fencing* until no NIXL request of it is in progress and no peer
may still touch its memory; :meth:`Endpoint.get_finished` reports a failure only then.

Threading (:mod:`kvgeom_nixl.threads`): every public call of an endpoint, of its links and of its
transfers' ``cancel`` holds ``endpoint.lock`` (a ``threading.RLock``, or the lock given), so any
thread may call them; nothing polls in the background unless a :class:`~kvgeom_nixl.Progressor`
is started: every wait loop calls ``progress()`` on its own endpoint and on the in-process peers it
is given, and a connector calls :meth:`Endpoint.get_finished` once per step. The contract
(registration, handshake, failure and invalid blocks) is docs/design.md §8; every copy is checked
to stay in its regions before posting (docs/design.md §4.2 (invariant 1)).

Hostile peers (docs/design.md §14): ``connect`` refuses payloads beyond the endpoint's
:class:`~kvgeom_nixl.handshake.HandshakeLimits`; every planning call of a link (``plan``, ``pull``,
``push``, ``serve_pull``, ``accept_push``) takes a ``strategy`` and a ``budget``
(:class:`kvgeom.PlanBudget`, the endpoint's by default) and refuses a request whose plan would
exceed it (:class:`kvgeom.PlanBudgetExceeded`) before building it; ``timeout_s`` must be finite and
positive, and the deadline starts before planning, so it covers the planning too.

Worked number: P TP2 -> D TP1 on 4 fresh blocks, HND, pull: D rank 0 posts 2 NIXL requests (one
per P rank); each P rank counts 1 consumer (``plan.consumers() == [1, 1]``).

With pipeline stages, DCP and replicas (docs/design.md §11) ranks are flat: a D rank connects to
the handshakes of every P rank of every stage, posts requests only to the P ranks its rows name
(those holding its layers and tokens), and a P rank pushes only its stage's layers. For P PP2 x
TP1 -> D TP2 each D rank posts 2 requests, one per P stage.
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

from kvgeom import (
    DEFAULT_BUDGET,
    CompiledPair,
    Copies,
    EngineGeometry,
    Pair,
    PlanBudget,
    PlanBudgetExceeded,
    PlanError,
    Rearrange,
    Request,
    RequestShape,
    TransferPlan,
    Zeros,
    check_budget,
    plan_pair,
    plan_reference,
    tile_bytes,
    value_text,
)
from kvgeom.lowering import check_in_regions, tile_index_blocks, tile_index_pairs
from kvgeom.values import CopyBlock, check_instance, check_int, check_seconds

from .agent import RankAgent, classify, nixl_errors
from .errors import DuplicateRequest, ExecutorError, HandshakeError, TransferFailed
from .handshake import DEFAULT_LIMITS, ROLES, HandshakeLimits, RankInfo, decode_rank, encode_rank
from .inbox import INBOX_MAX, INBOX_TTL_S, Inbox
from .lowering import MAX_TABLE_TILES, MODES, capped_table, copy_descs, table_descs
from .memory import RankMemory
from .packed import DEFAULT_GRACE_S, PackedTransfer
from .probe import ProbeRefused, prober
from .protocol import MAX_ID, encode, link_key, new_secret
from .receive import apply_receive_steps
from .staging import DEFAULT_SLOTS, StagingBuffer, run_steps
from .threads import locked
from .transfer import Poster, Transfer, TransferResult, wait_all

__all__ = ["Endpoint", "Link", "Transfer", "TransferResult", "wait_all", "MAX_TABLE_TILES", "DEFAULT_TIMEOUT_S",
           "check_timeout", "Finished", "HEARTBEAT_S"]

DEFAULT_TIMEOUT_S = 30.0
HEARTBEAT_S = 0.1  # how often an endpoint pings the peers its transfers wait on (a dead one refuses the send)
MAX_FINISHED = 1 << 16  # settled transfers get_finished keeps for its next call at most
RANK_STRATEGIES = ("direct", "staged")  # planned per rank on the compiled pair when a link plans itself


def check_timeout(path: str, timeout_s: Any) -> float:
    """A timeout in seconds: finite and > 0 (``nan`` would disable the deadline), else :class:`ExecutorError`."""
    return check_seconds(path, timeout_s, error=ExecutorError)


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
    that the first :meth:`connect` does not wait about a second for it (``benchmarks/connect.py``).

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
        self._mark_dead(agent, "closed", "the link was closed (its agent removed)")
        self._bury()

    def pending_notifications(self) -> dict[tuple[str, str], set[str]]:
        """D ranks' reqs no transfer has taken yet: ("req", request id) -> sender agents."""
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


class Link:
    """The local endpoint's connection to every rank of one peer engine; holds the :class:`Pair`."""

    def __init__(self, endpoint: Endpoint, peers: dict[int, RankInfo], pair: Pair) -> None:
        self.endpoint = endpoint
        self.peers = peers
        self.pair = pair
        self.peer_engine = next(iter(peers.values())).engine
        self._tile: int | None = None
        self.closed = False

    @property
    def lock(self) -> Any:
        """The endpoint's lock (every call of the link holds it)."""
        return self.endpoint.lock

    @property
    def local_is_decode(self) -> bool:
        return self.endpoint.role == "decode"

    # ---- planning --------------------------------------------------------------------------
    @locked
    def plan(self, request: Request, *, strategy: str = "direct", budget: PlanBudget | None = None) -> TransferPlan:
        """The plan for ``request`` on this pair (:func:`kvgeom.planning.plan_pair`) under ``budget``
        (default: the endpoint's); raises :class:`kvgeom.PlanBudgetExceeded` before building a plan
        beyond it. Packed and auto plans use :attr:`staging_bytes` as the chunk capacity, so without
        staging on both sides auto never picks packed and packed raises
        :class:`~kvgeom.errors.StagingCapacityError`."""
        return plan_pair(self.pair, request, strategy=strategy,  # type: ignore[arg-type]
                         staging_bytes=self.staging_bytes, budget=self.endpoint.budget if budget is None else budget)

    @property
    def staging_bytes(self) -> int:
        """The slot size both sides have (0 when either has no staging buffer): what a packed plan's
        busiest chunk may stage on one rank."""
        own = self.endpoint.staging
        sizes = [info.staging[3] if info.staging is not None else 0 for info in self.peers.values()]
        return min([own.slot_bytes if own is not None else 0] + sizes)

    @locked
    def rank_plan(self, request: Request, *, strategy: str = "direct", budget: PlanBudget | None = None) -> TransferPlan:
        """What this rank posts and applies for ``request``, planned on the compiled pair for this
        rank only (``plan.for_decode_rank(rank)`` on D, ``plan.for_prefill_rank(rank)``'s copies on
        P; docs/design.md §13.4). The pair compiles on the link's first request, when compiling fits
        ``budget`` (the endpoint's by default; else the reference path plans, the same rows); a
        request whose plan would exceed it raises :class:`kvgeom.PlanBudgetExceeded`."""
        plan, _ = self._planned(request, None, strategy, budget, "coalesced")
        return plan

    def _planned(self, request: Request | None, plan: TransferPlan | None, strategy: str, budget: PlanBudget | None,
                 mode: str) -> tuple[TransferPlan, tuple[CopyBlock, ...] | None]:
        """The plan a transfer call runs, and (mode prepped, this rank planned on the compiled pair)
        its copies as outer-sum blocks for the tile indices (no byte columns)."""
        if plan is not None or request is None or strategy not in RANK_STRATEGIES:
            return self._plan(request, plan, strategy, budget), None
        check_instance("request", request, Request, error=ExecutorError, fix="pass a kvgeom.Request")
        budget = self.endpoint.budget if budget is None else budget
        check_budget(self.pair, RequestShape.of(request), strategy, staging_bytes=self.staging_bytes, budget=budget)
        try:
            compiled: CompiledPair | None = self.pair.compile(budget=budget)
        except PlanBudgetExceeded:  # a pair too costly to compile plans on the reference path
            compiled = None
        rank, kw = self.endpoint.rank, {"decode_rank" if self.local_is_decode else "prefill_rank": self.endpoint.rank}
        blocks = None
        if compiled is None:
            whole = plan_reference(self.pair, request, strategy=strategy, budget=None)  # type: ignore[arg-type]
            plan = whole.for_decode_rank(rank) if self.local_is_decode else whole.packed_for_prefill_rank(rank)
        else:
            if mode == "prepped":
                blocks = compiled.copy_blocks(request, strategy=strategy, budget=None, **kw)  # type: ignore[arg-type]
            plan = compiled.plan(request, strategy=strategy, budget=None, **kw)  # type: ignore[arg-type]
        return self._plan(request, plan, strategy, budget), blocks

    @property
    def tile_bytes(self) -> int:
        if self._tile is None:
            self._tile = tile_bytes(self.pair)
        return self._tile

    # ---- initiators ----------------------------------------------------------------------
    @locked
    def pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
             budget: PlanBudget | None = None) -> Transfer:
        """D rank: ask every P rank it needs (``req``), READ this rank's rows from each once it grants,
        done when each has confirmed it still held its blocks (``held``); returns at once (a packed
        plan is pulled chunk by chunk through the staging rings, docs/design.md §12.5).

        Without ``plan`` the request is planned with ``strategy`` under ``budget`` (the endpoint's by
        default); ``timeout_s`` counts from this call, planning included."""
        started = time.perf_counter()
        timeout_s = self._begin("decode", "pull", request_id, timeout_s, request, plan)
        plan, blocks = self._planned(request, plan, strategy, budget, mode)
        if plan.packed:
            return self._packed("pull", request_id, request, plan, mode, timeout_s, started)
        t = self._transfer("pull", request_id, request, plan, self._mode(mode), timeout_s, started)
        if not self._expired(t, timeout_s):
            copies = plan.for_decode_rank(self.endpoint.rank).copies
            t.posters = self._posters(t, copies, "READ", blocks)
            if not t.settled:
                t.peers = {self.peers[p].agent: p for p in sorted(self._peer_ranks(copies))}
                t.consumers = self._consumers(request, plan, strategy, budget, set(t.peers.values()))
        return self.endpoint.track(t)

    @locked
    def push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
             mode: str = "coalesced", timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
             budget: PlanBudget | None = None) -> Transfer:
        """P rank: WRITE this rank's rows to every D rank that needs them once that D rank's
        ``accept_push`` has asked (``req``), done when each has acknowledged (``acked``); returns at
        once (packed: each chunk once its D slots are granted; ``strategy``, ``budget`` and
        ``timeout_s`` as in :meth:`pull`)."""
        started = time.perf_counter()
        timeout_s = self._begin("prefill", "push", request_id, timeout_s, request, plan)
        plan, blocks = self._planned(request, plan, strategy, budget, mode)
        if plan.packed:
            return self._packed("push", request_id, request, plan, mode, timeout_s, started)
        t = self._transfer("push", request_id, request, plan, self._mode(mode), timeout_s, started)
        if not self._expired(t, timeout_s):
            copies = plan.for_prefill_rank(self.endpoint.rank)
            t.posters = self._posters(t, copies, "WRITE", blocks)
            if not t.settled:
                t.peers = {self.peers[d].agent: d for d in sorted(self._peer_ranks(copies))}
        return self.endpoint.track(t)

    # ---- passive sides ---------------------------------------------------------------------
    @locked
    def accept_push(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
                    budget: PlanBudget | None = None) -> Transfer:
        """D rank: ask every P rank this rank reads from to push (``req``), wait for each WRITE's
        notification, run the receive steps and acknowledge (packed: grant slots as P asks, unpack
        each chunk as it lands; ``strategy``, ``budget`` and ``timeout_s`` as in :meth:`pull`)."""
        started = time.perf_counter()
        timeout_s = self._begin("decode", "accept_push", request_id, timeout_s, request, plan)
        plan = self._plan(request, plan, strategy, budget, "link.accept_push(request_id, request)")
        if plan.packed:
            return self._packed("accept_push", request_id, request, plan, "coalesced", timeout_s, started)
        rank = self.endpoint.rank
        t = self._transfer("accept_push", request_id, request, plan, "-", timeout_s, started,
                           bytes_moved=plan.for_decode_rank(rank).bytes_copied)
        t.peers = {self._peer(p).agent: p for p in plan.sources_of(rank)}
        return self.endpoint.track(t)

    @locked
    def serve_pull(self, request_id: str, request: Request | None = None, *, plan: TransferPlan | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S, strategy: str = "direct",
                   budget: PlanBudget | None = None) -> Transfer:
        """P rank: hold this rank's blocks for ``request_id``, grant each D rank that reads from it
        (``plan.consumers()``), done when each has confirmed its READ (packed: pack each chunk once
        its D slots are granted). :meth:`hold` is the same without a request.

        The plan is built from the peer's self-description under ``budget`` (the endpoint's by
        default), and ``timeout_s`` counts from this call, so a hostile geometry can neither make
        the planning unbounded nor hide it from the deadline."""
        started = time.perf_counter()
        timeout_s = self._begin("prefill", "serve_pull", request_id, timeout_s, request, plan)
        plan = self._plan(request, plan, strategy, budget, "link.serve_pull(request_id, request), or "
                          "link.hold(request_id) for a direct pull without the request")
        if plan.packed:
            return self._packed("serve_pull", request_id, request, plan, "coalesced", timeout_s, started)
        p = self.endpoint.rank
        mine = plan.for_prefill_rank(p)
        consumers = {int(d) for d in np.unique(mine.d_rank)}
        if len(consumers) != int(plan.consumers()[p]):
            raise ExecutorError("plan.consumers", "the consumer count disagrees with the plan's rows",
                                actual=int(plan.consumers()[p]), expected=len(consumers))
        t = self._transfer("serve_pull", request_id, request, plan, "-", timeout_s, started,
                           bytes_moved=mine.total_bytes)
        t.peers = {self._peer(d).agent: d for d in sorted(consumers)}
        t.expect_count = len(consumers)
        return self.endpoint.track(t)

    @locked
    def hold(self, request_id: str, *, consumers: int | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        """P rank, direct pulls, knowing only its own blocks: hold them for ``request_id`` until
        ``consumers`` D ranks (default: as many as the D ranks' ``req`` say) have READ them and
        confirmed, or until ``timeout_s``. No plan: D plans and READs; P grants every D rank of the
        link that asks for the id, and answers each READ's notification with ``held`` while it
        still holds (a READ that finishes after the hold ended gets ``cancel``: D fails it). The
        caller keeps the blocks untouched until the transfer settles."""
        started = time.perf_counter()
        timeout_s = self._begin("prefill", "hold", request_id, timeout_s, None, None)
        if consumers is not None:
            consumers = check_int("consumers", consumers, minimum=1, error=ExecutorError)
            if consumers > len(self.peers):
                raise ExecutorError("consumers", f"{consumers} D ranks on a link to {len(self.peers)}",
                                    actual=consumers, expected=f"<= {len(self.peers)}",
                                    fix="pass how many D ranks read this rank's blocks")
        ep = self.endpoint
        t = Transfer(ep, ep.rank_agent, "hold", request_id, None, None, "-", timeout_s, role=ep.role, rank=ep.rank,
                     peers={info.agent: r for r, info in self.peers.items()}, expect_count=consumers,
                     started=started, resend_s=ep.staging_grace_s)
        return ep.track(t)

    # ---- one request -----------------------------------------------------------------------
    def _begin(self, role: str, what: str, request_id: Any, timeout_s: Any, request: Any, plan: Any) -> float:
        """The checks every transfer call makes before any work: role, open link, id (not in flight
        on the endpoint), timeout, and (but for hold) a request or a plan."""
        self._require(role, what)
        if not isinstance(request_id, str) or not request_id or "|" in request_id or len(request_id) > MAX_ID:
            raise ExecutorError("request_id", f"{what} needs a non-empty string id without '|' (at most {MAX_ID} "
                                f"characters), got {type(request_id).__name__}", actual=value_text(request_id, 80),
                                expected="a string", fix="use the scheduler's request id as a string")
        timeout_s = check_timeout("timeout_s", timeout_s)
        if what != "hold" and request is None and plan is None:
            fix = {"pull": "link.pull(request_id, request)", "push": "link.push(request_id, request)",
                   "accept_push": "link.accept_push(request_id, request)",
                   "serve_pull": "link.serve_pull(request_id, request), or link.hold(request_id) to serve a "
                                 "direct pull knowing only this rank's blocks"}[what]
            raise ExecutorError("request", f"{what} needs the request (to plan it) or a plan", fix=fix)
        self.endpoint.check_id(request_id, what)
        return timeout_s

    @staticmethod
    def _expired(t: Transfer, timeout_s: float) -> bool:
        """Fail ``t`` (nothing posted) when planning used up its timeout."""
        if t.expired():
            t.fail("timeout", f"planning took longer than the {timeout_s:.3g} s timeout; nothing was posted")
            return True
        return False

    def _packed(self, kind: str, request_id: str, request: Request | None, plan: TransferPlan, mode: str,
                timeout_s: float, started: float) -> Transfer:
        """A packed request (docs/design.md §12.5); a plan this pair cannot run raises before anything moves."""
        ep = self.endpoint
        mode = self._mode(mode)
        if ep.staging is None:
            raise ExecutorError("staging", f"a packed plan needs a staging buffer on {ep.name}",
                                fix="create the endpoint with staging_bytes >= the plan's busiest chunk")
        if len(plan.copies) or plan.rearranges:
            raise ExecutorError("plan", "a packed plan with copies or rearranges (mixed plans are not executed)",
                                actual=(len(plan.copies), len(plan.rearranges)), expected=(0, 0))
        peer_col = plan.wire.p_rank if self.local_is_decode else plan.wire.d_rank
        own_col = plan.wire.d_rank if self.local_is_decode else plan.wire.p_rank
        peers = {int(p): self._peer(int(p)) for p in np.unique(peer_col[own_col == ep.rank])}
        invalid = self.pair.writable_blocks(request) if request is not None and self.local_is_decode else {}
        t: Transfer
        t = PackedTransfer(ep, ep.rank_agent, kind, request_id, request, plan, timeout_s, role=ep.role, rank=ep.rank,
                           buffer=ep.staging, peers=peers, run_steps=ep.run_staged,
                           receive=ep.receive if self.local_is_decode else None, grace_s=ep.staging_grace_s,
                           started=started, invalid_blocks=invalid)
        if mode == "prepped":
            t.fall_back("coalesced", "packed plans post their wire rows as coalesced lists")
        if self._expired(t, timeout_s):
            return ep.track(t)
        try:
            t.check_fit()
        except PlanError as e:
            t.fail("plan_error", f"{type(e).__name__}: {e}")
        return ep.track(t)

    def _transfer(self, kind: str, request_id: str, request: Request | None, plan: TransferPlan, mode: str,
                  timeout_s: float, started: float, *, bytes_moved: int = 0) -> Transfer:
        ep = self.endpoint
        invalid = self.pair.writable_blocks(request) if request is not None and self.local_is_decode else {}
        return Transfer(ep, ep.rank_agent, kind, request_id, request, plan, mode, timeout_s, role=ep.role,
                        rank=ep.rank, bytes_moved=bytes_moved, receive=ep.receive if self.local_is_decode else None,
                        started=started, invalid_blocks=invalid, resend_s=ep.staging_grace_s)

    def _peer_ranks(self, copies: Copies) -> set[int]:
        return {int(r) for r in np.unique(self._sides(copies)[0])}

    def _consumers(self, request: Request | None, plan: TransferPlan, strategy: str, budget: PlanBudget | None,
                   sources: set[int]) -> dict[str, int]:
        """D: per P agent, how many D ranks read from it (told in ``req``, so a P rank that holds
        without a plan knows when it is done): from the whole plan, or (a plan of this rank only)
        from each source's own rank plan on the compiled pair."""
        rank_plan = plan.decode_ranks > 1 and not len(plan.copies.take(plan.copies.d_rank != self.endpoint.rank)) \
            and request is not None and strategy in RANK_STRATEGIES
        counts = plan.consumers()
        out: dict[str, int] = {}
        for p in sources:
            n = int(counts[p])
            if rank_plan and request is not None:
                try:
                    compiled = self.pair.compile(budget=self.endpoint.budget if budget is None else budget)
                    theirs = compiled.plan(request, strategy=strategy, budget=None,  # type: ignore[arg-type]
                                           prefill_rank=p)
                    n = len({int(d) for d in np.unique(theirs.copies.d_rank)})
                except PlanBudgetExceeded:
                    n = 0  # unknown: a P rank that holds without a plan waits for its timeout
            out[self.peers[p].agent] = n
        return out

    def _posters(self, t: Transfer, copies: Copies, op: str,
                 blocks: tuple[CopyBlock, ...] | None = None) -> dict[str, Poster]:
        """Lower this rank's ``copies`` to one NIXL request per peer rank, posted once the protocol
        lets it (:meth:`Transfer._post_to`, with that peer's signed notification).

        Every row is checked against the regions the two ranks hold (a region of another pipeline
        stage has 0 bytes there, docs/design.md §11.4) before anything is posted. A bad plan fails
        ``t``; a plan that needs a peer rank this link was not given raises :class:`ExecutorError`.
        """
        agent = self.endpoint.rank_agent
        out: dict[str, Poster] = {}
        try:
            peer_col, lreg, loff, rreg, roff = self._sides(copies)
            peers = [self._peer(int(p)) for p in np.unique(peer_col)]  # every peer the rows need, first
            rows_of = {info.rank: np.flatnonzero(peer_col == info.rank) for info in peers}
            for info in peers:
                mine = copies.take(rows_of[info.rank])
                if self.local_is_decode:
                    check_in_regions(mine, info.sizes, self.endpoint.memory.sizes)
                else:
                    check_in_regions(mine, self.endpoint.memory.sizes, info.sizes)
            prepped = self._tile_indices(t, copies, rows_of, blocks) if t.mode == "prepped" and len(copies) else None
            for info in peers:
                rows = rows_of[info.rank]
                nbytes = int(copies.nbytes[rows].sum())
                if prepped is None:
                    local = copy_descs(self.endpoint.memory.bases, self.endpoint.memory.devices, lreg[rows],
                                       loff[rows], copies.nbytes[rows])
                    remote = copy_descs(info.bases, info.devices, rreg[rows], roff[rows], copies.nbytes[rows])

                    def coalesced(notif: bytes, local: np.ndarray = local, remote: np.ndarray = remote,
                                  info: RankInfo = info, n: int = len(rows), nbytes: int = nbytes) -> tuple[Any, int, int]:
                        return agent.post_coalesced(op, local, remote, info.mem_type, info.agent, notif), n, nbytes

                    out[info.agent] = coalesced
                else:
                    local_idx, remote_idx = prepped[info.rank]
                    local_table, remote_table = self._local_table(), self._remote_table(info)

                    def indexed(notif: bytes, li: np.ndarray = local_idx, ri: np.ndarray = remote_idx,
                                lt: Any = local_table, rt: Any = remote_table, nbytes: int = nbytes) -> tuple[Any, int, int]:
                        return agent.post_prepped(op, lt, li, rt, ri, notif), len(li), nbytes

                    out[info.agent] = indexed
        except nixl_errors() as e:
            t.fail(classify(e), f"posting: {type(e).__name__}: {e}")
        except (PlanError, RuntimeError, KeyError) as e:
            t.fail("plan_error" if isinstance(e, PlanError) else "nixl_error", f"posting: {type(e).__name__}: {e}")
        return out

    def _sides(self, copies: Copies) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(peer rank, local region, local offset, peer region, peer offset) columns."""
        if self.local_is_decode:
            return copies.p_rank, copies.d_region, copies.d_offset, copies.p_region, copies.p_offset
        return copies.d_rank, copies.p_region, copies.p_offset, copies.d_region, copies.d_offset

    def _tile_indices(self, t: Transfer, copies: Copies, rows_of: dict[int, np.ndarray],
                      blocks: tuple[CopyBlock, ...] | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
        """Mode prepped: per peer rank, (local indices, peer indices) into the two ranks' tables, or
        ``None`` (``t`` falls back to coalesced) when the plan is off the tile grid or a table is
        too large. Each rank's table has tiles only for the regions it holds. With ``blocks`` (the
        compiled pair's rows of this rank) the indices come straight from them
        (:func:`kvgeom.lowering.tile_index_blocks`), not from the byte columns."""
        tile = self.tile_bytes
        me = self.endpoint.rank
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        try:
            if blocks is not None:
                pair = self.pair
                got = tile_index_blocks(blocks, tile, p_tables=lambda r: capped_table(pair.prefill, tile, r),
                                        d_tables=lambda r: capped_table(pair.decode, tile, r))
                for (p_rank, d_rank), (p_idx, d_idx) in got.items():
                    peer = p_rank if self.local_is_decode else d_rank
                    out[peer] = (d_idx, p_idx) if self.local_is_decode else (p_idx, d_idx)
                if set(out) != set(rows_of):
                    raise PlanError("blocks", "the blocks and the plan's copies name different peers",
                                    actual=sorted(out), expected=sorted(rows_of))
                return out
            for peer, rows in rows_of.items():
                p_rank, d_rank = (peer, me) if self.local_is_decode else (me, peer)
                p_idx, d_idx = tile_index_pairs(copies.take(rows), tile,
                                                p_table=capped_table(self.pair.prefill, tile, p_rank),
                                                d_table=capped_table(self.pair.decode, tile, d_rank))
                out[peer] = (d_idx, p_idx) if self.local_is_decode else (p_idx, d_idx)
        except PlanError as e:
            t.fall_back("coalesced", e.message)
            return None
        return out

    def _local_table(self) -> Any:
        """This rank's prepared table (shared by every link of the endpoint)."""
        mem = self.endpoint.memory
        return self._prepared("", self.endpoint.engine, self.endpoint.rank, mem.bases, mem.devices, mem.mem_type)

    def _remote_table(self, info: RankInfo) -> Any:
        return self._prepared(info.agent, info.engine, info.rank, info.bases, info.devices, info.mem_type)

    def _prepared(self, agent_name: str, engine: EngineGeometry, rank: int, bases: np.ndarray, devices: np.ndarray,
                  mem_type: str) -> Any:
        agent = self.endpoint.rank_agent
        handle = agent.prepared(agent_name, self.tile_bytes)
        if handle is None:
            descs = table_descs(bases, devices, capped_table(engine, self.tile_bytes, rank))
            handle = agent.prepare(agent_name, self.tile_bytes, descs, mem_type)
        return handle

    # ---- checks ----------------------------------------------------------------------------
    def _peer(self, rank: int) -> RankInfo:
        if rank not in self.peers:
            raise ExecutorError("peer rank", f"the plan needs peer rank {rank}, which this link was not given",
                                actual=rank, expected=sorted(self.peers),
                                fix="connect with the handshake of every peer rank the plan uses")
        return self.peers[rank]

    def _require(self, role: str, what: str) -> None:
        if self.closed or self.endpoint.closed:
            raise ExecutorError("link", f"{what} on a closed link", fix="connect again")
        if self.endpoint.role != role:
            raise ExecutorError("role", f"{what} runs on a {role} rank, this one is {self.endpoint.role}",
                                actual=self.endpoint.role, expected=role)

    def _mode(self, mode: str) -> str:
        if mode not in MODES:
            raise ExecutorError("mode", f"unknown lowering mode {value_text(mode, 60)}", actual=mode, expected=list(MODES))
        return mode

    def _plan(self, request: Request | None, plan: TransferPlan | None, strategy: str = "direct",
              budget: PlanBudget | None = None, fix: str = "link.pull(request_id, request)") -> TransferPlan:
        if request is not None:
            check_instance("request", request, Request, error=ExecutorError, fix="pass a kvgeom.Request")
        if plan is None:
            if request is None:
                raise ExecutorError("request", "pass the request (to plan it) or a plan", fix=fix)
            if strategy in RANK_STRATEGIES:  # this rank's part only, on the compiled pair
                return self.rank_plan(request, strategy=strategy, budget=budget)
            plan = self.plan(request, strategy=strategy, budget=budget)  # auto may pick packed: the whole plan
        check_instance("plan", plan, TransferPlan, error=ExecutorError, fix="pass the plan kvgeom made")
        if plan.prefill_tp != self.pair.prefill.tp or plan.decode_tp != self.pair.decode.tp:
            raise ExecutorError("plan", f"plan for TP{plan.prefill_tp}->TP{plan.decode_tp} on a "
                                f"TP{self.pair.prefill.tp}->TP{self.pair.decode.tp} pair",
                                actual=(plan.prefill_tp, plan.decode_tp),
                                expected=(self.pair.prefill.tp, self.pair.decode.tp))
        if (plan.prefill_ranks, plan.decode_ranks) != (self.pair.prefill.num_ranks, self.pair.decode.num_ranks):
            raise ExecutorError("plan", f"plan for {plan.prefill_ranks} -> {plan.decode_ranks} ranks on a pair of "
                                f"{self.pair.prefill.num_ranks} -> {self.pair.decode.num_ranks} ranks",
                                actual=(plan.prefill_ranks, plan.decode_ranks),
                                expected=(self.pair.prefill.num_ranks, self.pair.decode.num_ranks))
        return plan

    # ---- teardown --------------------------------------------------------------------------
    @locked
    def close(self) -> None:
        """Release the prepared peer tables and forget the peer agents."""
        if self.closed:
            return
        self.closed = True
        for info in self.peers.values():
            self.endpoint.rank_agent.remove_peer(info.agent)
            self.endpoint.peer_removed(info.agent)  # "agent removed": its transfers fail, their fences lift

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
