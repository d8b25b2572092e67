"""Packed pulls through the connector: D's offer, P's same plan (docs/design.md §15.3).

A packed plan (§12) needs P to pack exactly what D unpacks, and the connector's P knows only its
own blocks. So before a packed pull D hands each P rank it reads from the request it planned, over
the side channel, signed with their link's key::

    D rank (jobs thread)                                   P rank (side-channel thread)
      plan = link.plan(request, "auto") -> packed
      offer {request document, staging_bytes,    ---->     check the MAC (the link's key), bound it,
             plan digest, MAC}                              plan the document "packed" at that
                                                            capacity (outside the lock), digest equal
      link.pull(plan)  -- req -->                  <----   {"ok": true} (else {"error": why}: D's pull
                                                            fails before anything is posted)
                                                           progress thread: D's req for a pending
                                                            send with an offer -> link.serve_pull(plan)

The digest (:func:`plan_digest`) covers everything P does and where D expects it: every wire row
and every pack and unpack step. Two planners that disagree (another kvgeom version, another
staging capacity) therefore refuse the pull instead of moving bytes into the wrong places.

What D does not trust P with, and what P does not trust D with: P checks the MAC before it parses
a byte of the document, the document is bounded (``MAX_DOCUMENT``) and decoded strictly
(``kvgeom.tools.loads``), planning runs under P's endpoint budget, and P keeps at most
:data:`MAX_OFFERS` offers, each for at most :data:`OFFER_TTL_S` or until its send is freed.
The offer lets a D rank of a linked engine choose which of P's blocks P packs; that D rank can
READ P's registered memory anyway (the link's trust, §8.1), so it gains nothing it lacked.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvgeom import KvGeomError, PlanBudget, Request, TransferPlan, plan_pair
from kvgeom.tools import dumps, loads
from kvgeom_nixl.endpoint import Link

from .side_channel import PackedOffer, SideChannelError, send_packed

__all__ = ["plan_digest", "offer_packed", "PlannedOffer", "check_offer", "plan_offer", "MAX_OFFERS", "OFFER_TTL_S",
           "OFFER_TIMEOUT_S"]

MAX_OFFERS = 4096  # offers one P rank keeps (for sends it holds or is about to)
OFFER_TTL_S = 600.0  # an offer whose send never came is forgotten after this
OFFER_TIMEOUT_S = 15.0  # D waits this long for each P rank's answer (P plans the offer in it)


def plan_digest(plan: TransferPlan) -> str:
    """SHA-256 of a packed plan's wire rows and pack and unpack steps (64 hex digits): equal for
    equal plans, and for two plans that differ in any row, step, offset or page."""
    h = hashlib.sha256(b"kvgeom-packed-plan-1")
    w = plan.wire
    for col in (w.chunk, w.p_rank, w.p_offset, w.d_rank, w.d_offset, w.nbytes):
        a = np.ascontiguousarray(col, dtype=np.int64)
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.tobytes())
    for steps in (plan.packs, plan.unpacks):
        h.update(len(steps).to_bytes(8, "little"))
        for st in steps:
            h.update(repr((st.side, st.chunk, st.p_rank, st.d_rank, st.page_bytes, st.shape, st.cache_strides,
                           st.staging_strides, st.unit_bytes)).encode())
            for a in (st.regions, st.offsets, st.staged, st.pages, st.page_staged):
                b = np.ascontiguousarray(a, dtype=np.int64)
                h.update(b.shape[0].to_bytes(8, "little") if b.ndim else b"\0" * 8)
                h.update(repr(b.shape).encode())
                h.update(b.tobytes())
    return h.hexdigest()


def offer_packed(link: Link, request: Request, plan: TransferPlan, *, request_id: str, engine: str, rank: int,
                 tp: int, host: str, port: int, timeout_s: float) -> list[int]:
    """D: hand every P rank this D rank reads from in ``plan`` (on ``port + p``) the signed offer of
    ``request``; returns those P ranks once each said it planned the same plan. Raises
    :class:`SideChannelError` with P's reason when one refused or could not be reached."""
    document, digest = dumps(request), plan_digest(plan)
    sources = sorted({int(p) for p in np.unique(plan.wire.p_rank[plan.wire.d_rank == rank])})
    base = PackedOffer(engine, rank, tp, "", request_id, document, link.staging_bytes, digest)
    body = hashlib.sha256(base.signed_bytes()).digest()
    for p in sources:
        agent, mac = link.sign_document(p, request_id, body)
        send_packed(host, port + p, replace(base, agent=agent, mac=mac), timeout_s=timeout_s)
    return sources


@dataclass(frozen=True)
class PlannedOffer:
    """P: an offer it accepted: the link it came on, the plan P packs for, when it arrived."""

    link: Link
    plan: TransferPlan
    digest: str
    arrived: float


def check_offer(link: Link, offer: PackedOffer, lock: Any) -> None:
    """P: the offer's MAC, under the link key (the document hashed before ``lock`` is taken: a
    forged offer costs no time under it beyond one HMAC of a short body); :class:`SideChannelError`
    when D rank ``offer.d_rank`` of the link did not sign it."""
    body = hashlib.sha256(offer.signed_bytes()).digest()
    with lock:
        signer = link.document_signer(offer.agent, offer.request, body, offer.mac)
    if signer is None or signer != offer.d_rank:
        raise SideChannelError("packed.mac", f"the offer for {offer.request!r:.80} is not signed by D rank "
                               f"{offer.d_rank} of engine {offer.engine!r:.80} (agent {offer.agent!r:.80})",
                               fix="sign offers with Link.sign_document on the link this P rank handshook")


def plan_offer(link: Link, offer: PackedOffer, budget: PlanBudget) -> PlannedOffer:
    """P: plan a checked offer (:func:`check_offer`) the way D did, outside any lock;
    :class:`SideChannelError` naming the field it refuses."""
    if offer.staging_bytes > link.staging_bytes:
        raise SideChannelError("packed.staging_bytes", f"the offer for {offer.request!r:.80} is cut for "
                               f"{offer.staging_bytes} B slots, beyond this link's {link.staging_bytes} B",
                               actual=offer.staging_bytes, expected=f"<= {link.staging_bytes}")
    try:
        request = loads(offer.document, expect=Request)
        plan = plan_pair(link.pair, request, strategy="packed", staging_bytes=offer.staging_bytes, budget=budget)
    except KvGeomError as e:
        raise SideChannelError("packed.document", f"P cannot plan the offer for {offer.request!r:.80}: "
                               f"{type(e).__name__}: {e}"[:400]) from None
    digest = plan_digest(plan)
    if digest != offer.digest:
        raise SideChannelError("packed.digest", f"P's packed plan of {offer.request!r:.80} differs from D's",
                               actual=digest, expected=offer.digest,
                               fix="run the same kvgeom version on both engines")
    return PlannedOffer(link, plan, digest, time.monotonic())
