"""Helpers for the executor's tests and checks: one engine in a child process, driven over a pipe.

    parent (this process)                         child (multiprocessing "spawn")
      ctx.Process(target=engine_process, args=(conn, pair_file_text, side, device))
                                                  fill its caches (simulator), one Endpoint per rank
                                        <-------  ("hello", [handshake of each rank])
      ("connect", [peer handshakes])    ------->  connect every rank to the peer engine
                                        <-------  ("ready",)
      ("serve_pull" | "pull" | "push" | "accept_push", request_id, mode, timeout_s[, strategy])
                                        ------->  post on every rank, drive to the end
                                        <-------  ("done", [result dicts], verdict) | ("failed", reason, detail)
      ("status",)                       ------->  ("status", {in_flight, fencing, slots_free, slots,
                                                  unreleased}) after driving fences for up to 10 s
      ("die",)                          ------->  os._exit(0) with no cleanup (a crashed peer)
      ("close",)                        ------->  close every endpoint and exit

Between commands the child sits in ``conn.recv`` and does not poll NIXL: a peer that never
progresses. A decode child checks every D byte with :func:`kvgeom.checking.check_decode` before it answers ``done`` (the verdict is the
violation count and the bytes checked). Everything that crosses the pipe is bytes or plain data.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from typing import Any

import attrs

from kvgeom import InternalError, plan_pair
from kvgeom.tools import parse_pair_file

from .agent import use_local_defaults
from .endpoint import Endpoint
from .errors import ExecutorError, TransferFailed
from .local import LocalDeployment, allocate_caches, check_caches, fill_caches, rank_buffers, slot_bytes_for
from .transfer import wait_all

__all__ = ["engine_process", "result_dict", "requested_device", "run_local", "free_ports"]

_HANDED_OUT: set[int] = set()


def free_ports(count: int = 1, *, host: str = "127.0.0.1") -> int:
    """A port ``p`` with ``p .. p + count - 1`` free on ``host`` (a P engine's rank r listens on
    ``p + r``), for tests and benchmarks that start side channels.

    Drawn in 20000-32000, below Linux's ephemeral range (32768-60999) where the kernel and vLLM's
    own ``get_open_port`` pick theirs, and never the same port twice in this process: a vLLM
    instance binds its side channel only once its workers are up, long after the port was chosen.
    """
    if not isinstance(count, int) or not 1 <= count <= 64:
        raise ExecutorError("count", f"free_ports needs 1 to 64 consecutive ports, got {count!r}",
                            fix="free_ports(count) with count = the P engine's TP size")
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000 - count)
        ports = range(base, base + count)
        if _HANDED_OUT.intersection(ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        _HANDED_OUT.update(ports)
        return base
    raise RuntimeError(f"free_ports: no {count} consecutive free ports on {host} in 20000-32000 after 500 draws")


def result_dict(r: Any) -> dict[str, Any]:
    """A :class:`TransferResult` as plain data (notes as ``{"kind", "text"}`` strings)."""
    out = attrs.asdict(r, recurse=False)
    out["notes"] = [{"kind": n.kind.value, "text": n.text} for n in r.notes]
    return out


def engine_process(conn: Any, pair_file_text: str, side: str, device: str = "cpu", staging_bytes: int = 0) -> None:
    """Child entry point: host every rank of ``side`` ("prefill" or "decode") of the pair (with
    staging slots of ``staging_bytes`` for packed plans)."""
    use_local_defaults()
    pair, request = parse_pair_file(json.loads(pair_file_text))
    if not (request is not None):
        raise InternalError("the parent always sends a request")
    engine = pair.side(side)
    other = pair.decode if side == "prefill" else pair.prefill
    mine = allocate_caches(engine, device)
    scratch = allocate_caches(other, "cpu")  # the other side's fill is computed and dropped
    if side == "prefill":
        fill_caches(pair, request, mine, scratch)
    else:
        fill_caches(pair, request, scratch, mine)
    del scratch
    eps = [Endpoint(engine, side, r, rank_buffers(engine, mine, r), staging_bytes=staging_bytes)
           for r in range(engine.num_ranks)]
    posted = _record_handles(eps)
    conn.send(("hello", [e.handshake() for e in eps]))
    links: list[Any] = []
    while True:
        msg = conn.recv()
        cmd = msg[0]
        if cmd == "connect":
            links = [e.connect(msg[1]) for e in eps]
            conn.send(("ready",))
        elif cmd in ("serve_pull", "pull", "push", "accept_push"):
            _, rid, mode, timeout_s, *rest = msg
            strategy = rest[0] if rest else "direct"
            try:
                if cmd in ("pull", "push"):
                    ts = [getattr(lk, cmd)(rid, request, mode=mode, timeout_s=timeout_s, strategy=strategy)
                          for lk in links]
                else:
                    ts = [getattr(lk, cmd)(rid, request, timeout_s=timeout_s, strategy=strategy) for lk in links]
                results = wait_all(ts, peers=eps)
            except TransferFailed as failure:
                conn.send(("failed", failure.reason, str(failure)))
                continue
            verdict = None
            if side == "decode":
                violations, checked = check_caches(pair, request, mine)
                verdict = (len(violations), checked, [str(v) for v in violations[:3]])
            conn.send(("done", [result_dict(r) for r in results], verdict))
        elif cmd == "status":
            conn.send(("status", _status(eps, posted)))
        elif cmd == "die":
            os._exit(0)
        elif cmd == "close":
            for ep in eps:
                ep.close()
            conn.send(("closed",))
            return


def _record_handles(eps: list[Endpoint]) -> list[Any]:
    """Every NIXL request handle the endpoints' agents post from now on (for ``status``)."""
    posted: list[Any] = []

    def recording(post: Any) -> Any:
        def recorded(*args: Any) -> Any:
            handle = post(*args)
            posted.append(handle)
            return handle
        return recorded

    for ep in eps:
        for name in ("post_coalesced", "post_prepped"):
            setattr(ep.rank_agent, name, recording(getattr(ep.rank_agent, name)))
    return posted


def _status(eps: list[Endpoint], posted: list[Any]) -> dict[str, int]:
    """Drive every endpoint until nothing is in flight or fencing (10 s at most), then count what is
    left: transfers, staging slots not free, and posted handles NIXL was never told to release."""
    deadline = time.perf_counter() + 10
    while any(ep.in_flight or ep.fencing for ep in eps) and time.perf_counter() < deadline:
        for ep in eps:
            ep.progress()
    rings = [ep.staging for ep in eps if ep.staging is not None]
    return {"in_flight": sum(len(ep.in_flight) for ep in eps), "fencing": sum(len(ep.fencing) for ep in eps),
            "slots_free": sum(r.free() for r in rings), "slots": sum(r.slots for r in rings),
            "unreleased": sum(not getattr(h, "_released", True) for h in posted), "posted": len(posted)}


def requested_device(name: str | None = None) -> str:
    """The device the executor tests run on: ``name``, else ``$KVGEOM_DEVICE``, else ``cpu``.

    Calls ``pytest.skip("no CUDA device")`` when CUDA is asked for and torch has none.
    """
    import torch

    dev = name or os.environ.get("KVGEOM_DEVICE", "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        import pytest

        pytest.skip("no CUDA device", allow_module_level=True)
    return dev


def run_local(pair: Any, request: Any, *, push: bool = False, mode: str = "coalesced", device: str = "cpu",
              telemetry: bool = False, plan: Any = None, timeout_s: float = 20.0) -> dict[str, Any]:
    """Fill, plan, transfer in-process, check: everything a test asserts on, in one dict."""
    if plan is None:
        plan = plan_pair(pair, request)
    p_caches = allocate_caches(pair.prefill, device)
    d_caches = allocate_caches(pair.decode, device)
    fill_caches(pair, request, p_caches, d_caches)
    with LocalDeployment(pair, p_caches, d_caches, telemetry=telemetry, staging_bytes=slot_bytes_for(plan)) as dep:
        results = dep.run("req-0", request, plan, push=push, mode=mode, timeout_s=timeout_s)
    violations, checked = check_caches(pair, request, d_caches)
    return {"plan": plan, "results": results, "violations": violations, "checked": checked,
            "p_caches": p_caches, "d_caches": d_caches}
