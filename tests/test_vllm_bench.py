"""``python -m benchmarks.vllm_connector`` without vLLM: its arguments, the timing hooks on stand-in
connector classes, the per-request arithmetic and the table (no instance started, nothing timed).

The hooks wrap methods by name (:mod:`benchmarks.vllm_timing`); the stand-ins here have the same
names and signatures as kvgeom's ``ConnectorExecutor``/``Transfer`` and vLLM's
``NixlPullConnectorWorker``, and the expected numbers are the stand-ins' own clock readings.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from benchmarks import vllm_timing
from benchmarks.vllm_connector import Sample, parse_args, render
from benchmarks.vllm_timing import (
    RequestTiming,
    install_kvgeom,
    install_kvgeom_engine,
    install_nixl,
    read_events,
    request_timings,
)

# ---- arguments ---------------------------------------------------------------------------------------


def test_defaults_are_a_4k_prompt_five_requests_both_connectors_and_eager() -> None:
    a = parse_args([])
    assert (a.tokens, a.requests, a.connectors) == (4096, 5, ["nixl", "kvgeom", "kvgeom-eager"])
    assert parse_args(["--connectors", "kvgeom-before,kvgeom,nixl"]).connectors == ["kvgeom-before", "kvgeom", "nixl"]


@pytest.mark.parametrize("argv", [["--tokens", "100"], ["--tokens", "0"], ["--requests", "0"],
                                  ["--connectors", "nixl,vllm"], ["--connectors", "nixl,nixl"], ["--connectors", ""]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


# ---- the hooks on stand-ins --------------------------------------------------------------------------


class Clock:
    """A fake ``time.perf_counter`` stepping 1.0 per reading (and ``thread_time`` 0.5)."""

    def __init__(self) -> None:
        self.t, self.c = 0.0, 0.0

    def perf_counter(self) -> float:
        self.t += 1.0
        return self.t

    def thread_time(self) -> float:
        self.c += 0.5
        return self.c


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(vllm_timing, "time", types.SimpleNamespace(perf_counter=c.perf_counter,
                                                                   thread_time=c.thread_time))
    return c


def kvgeom_module() -> Any:
    """Stand-ins for kvgeom_nixl.vllm.executor's ConnectorExecutor and kvgeom_nixl.transfer's Transfer."""

    class Transfer:
        def __init__(self, request_id: str) -> None:
            self.kind, self.request_id, self.posters = "pull", request_id, {"agent": object()}

        def _post_to(self, agent: str, notif_kind: str) -> None:
            self.posters.pop(agent, None)

    class ConnectorExecutor:
        def __init__(self) -> None:
            self._pulls: dict[str, Any] = {}
            self._out = types.SimpleNamespace(failed={})
            self.queued: list[Any] = []

        def pull(self, job: Any) -> None:  # (the jobs thread calls _start_pull later)
            self.queued.append(job)

        def _start_pull(self, job: Any) -> None:
            self._pulls[job.transfer_id] = job

        def _d_finished(self, ep: Any) -> None:
            self._pulls.pop(ep, None)  # (here ``ep`` names the transfer that finishes)

    class KvgeomWorker:  # (kvgeom_nixl.vllm.worker's: start_load_kv queues the step's pulls)
        def __init__(self, ex: Any) -> None:
            self.ex = ex

        def start_load_kv(self, meta: list[Any]) -> None:
            for job in meta:
                self.ex.pull(job)

    return types.SimpleNamespace(ConnectorExecutor=ConnectorExecutor, Transfer=Transfer, KvgeomWorker=KvgeomWorker)


def test_kvgeom_hooks_time_plan_post_the_read_and_done(tmp_path: Path, clock: Clock) -> None:
    mod, path = kvgeom_module(), tmp_path / "ev.jsonl"
    for _ in range(2):  # idempotent: one wrapper, one event per call
        install_kvgeom(mod, str(path))
        install_kvgeom_engine(mod, str(path))
    ex = mod.ConnectorExecutor()
    w = mod.KvgeomWorker(ex)
    job = types.SimpleNamespace(request_id="d1", transfer_id="p1", local_blocks=((4, 5, 6),))
    # the engine thread: start_load_kv t=1, cpu 0.5; queued at t=2, its write read cpu 1.0 and 1.5
    # (0.5 of the hooks' own); the call ends at t=3, cpu 2.0: 1.5 - 0.5 = 1.0 on the engine thread
    w.start_load_kv([job])
    w.start_load_kv([])  # (started no pull: not an event; t=4..5, cpu 2.5, 3.0)
    ex._start_pull(job)  # the jobs thread: post t=6..7 (cpu 0.5)
    t = mod.Transfer("p1")
    t._post_to("agent", "grant")  # the READ: t=8..9 (cpu 0.5)
    t._post_to("agent", "grant")  # (nothing left to post: not an event)
    ex._d_finished("other")  # p1 still in flight: no done (the clock read t=10)
    ex._d_finished("p1")  # done at t=11
    events, offset = read_events(path)
    assert [e["kind"] for e in events] == ["queued", "engine", "post", "post_part", "done"]
    assert offset == path.stat().st_size and read_events(path, offset) == ([], offset)
    got = request_timings(events)
    assert got == RequestTiming(overhead=2.0, overhead_cpu=1.0, queue_to_post=7.0, transfer=2.0, blocks=3,
                                engine_cpu=1.0)


def test_nixl_hooks_time_read_blocks_for_req_and_done(tmp_path: Path, clock: Clock) -> None:
    class NixlPullConnectorWorker:
        def __init__(self) -> None:
            self._recving_transfers: dict[str, list[int]] = {}
            self.other: dict[str, list[int]] = {}

        def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
            self._recving_transfers[req_id] = [7]

        def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
            done = set(transfers)
            transfers.clear()
            return done, set()

        def start_load_kv(self, metadata: Any) -> None:
            for req_id, meta in metadata.reqs_to_recv.items():
                self._read_blocks_for_req(req_id, meta)

    path = tmp_path / "ev.jsonl"
    install_nixl(types.SimpleNamespace(NixlPullConnectorWorker=NixlPullConnectorWorker), str(path))
    w = NixlPullConnectorWorker()
    # start_load_kv t=1 (cpu 0.5) around the post t=2..3 (cpu 1.0..1.5), whose write reads cpu 2.0
    # and 2.5; the call ends at t=4, cpu 3.0: 2.5 - 0.5 = 2.0 on the engine thread
    w.start_load_kv(types.SimpleNamespace(reqs_to_recv={"d1": types.SimpleNamespace(local_block_ids=[[1, 2]])}))
    w.other["x"] = [1]
    w._pop_done_transfers(w.other)  # not the receiving transfers: no event
    w._pop_done_transfers(w._recving_transfers)  # done at t=5
    got = request_timings(read_events(path)[0])
    assert got == RequestTiming(overhead=1.0, overhead_cpu=0.5, queue_to_post=1.0, transfer=2.0, blocks=2,
                                engine_cpu=2.0)


def ev(kind: str, **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "req": "d1", **kw}


GOOD = [ev("engine", reqs=["d1", "d9"], t0=0.0, t1=0.1, cpu=0.5), ev("engine", reqs=["d8"], t0=0.2, t1=0.3, cpu=7.0),
        ev("queued", t=0.0), ev("post", t0=1.0, t1=2.0, cpu=0.25, posted=True, tid="p1", blocks=1),
        ev("post_part", tid="p1", t0=3.0, t1=5.0, cpu=0.5), ev("post_part", tid="p2", t0=3.0, t1=9.0, cpu=9.0),
        ev("done", t=6.0)]


def test_request_timings_sum_the_posting_parts_of_this_transfer_only() -> None:
    """(engine: the call that started d1 and d9, shared evenly; not d8's)"""
    assert request_timings(GOOD) == RequestTiming(3.0, 0.75, 5.0, 1.0, 1, engine_cpu=0.25)


@pytest.mark.parametrize("events, why", [
    (GOOD[:-1], "one posted pull and one done"),  # never seen done
    (GOOD + [ev("done", t=7.0)], "one posted pull and one done"),  # two requests in one window
    ([*GOOD[:-1], ev("done", t=6.0, failed=True)], "did not finish well"),
    ([*GOOD[:-1], {**GOOD[-1], "req": "d2"}], "did not finish well"),
    ([*GOOD[:-1], ev("done", t=0.5)], "out of order"),  # done before the post began
    ([*GOOD[:-1], ev("done", t=1.5)], "posted after it was seen done"),
    ([*GOOD[:-1], ev("done", t=4.0)], "posted after it was seen done"),
    ([{**e, "posted": False} if e["kind"] == "post" else e for e in GOOD], "one posted pull"),
    (GOOD[1:], "no engine-thread event"),  # (the engine hook missing: no row)
])
def test_request_timings_refuse_what_is_not_one_good_transfer(events: list[dict[str, Any]], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        request_timings(events)


def test_a_torn_last_line_waits_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n" + '{"kind": "po')
    events, offset = read_events(path)
    assert events == [GOOD[0]] and offset == len(json.dumps(GOOD[0])) + 1
    assert read_events(tmp_path / "absent.jsonl", 5) == ([], 5)


# ---- the table ---------------------------------------------------------------------------------------


def sample(scale: float) -> Sample:
    return Sample(RequestTiming(0.001 * scale, 0.0005 * scale, 0.002 * scale, 0.004 * scale, 3, 0.0002 * scale),
                  0.01 * scale, True)


def test_the_table_has_medians_in_ms_and_ratios_over_nixl() -> None:
    samples = {"nixl": {k: [sample(1), sample(1), sample(100)] for k in ("prompt", "hit")},
               "kvgeom": {k: [sample(2), sample(3), sample(2)] for k in ("prompt", "hit")}}
    out = render(samples, 4096, 3, "1.00 2.00 3.00", 2048)
    lines = out.splitlines()
    assert "load average 1.00 2.00 3.00" in lines[0] and lines[1].split() == ["nixl", "kvgeom", "kvgeom/nixl"]
    assert lines[2].startswith("4096-token prompt (8.0 MiB pulled)")
    assert lines[3].split()[-3:] == ["1.000", "2.000", "2.00"]  # medians 1 and 2 ms: 2x
    assert "D engine thread, CPU (ms)" in lines[5] and lines[5].split()[-3:] == ["0.200", "0.400", "2.00"]
    assert lines[8].split()[-3:] == ["10.000", "20.000", "2.00"]  # TTFT
    assert "nixl 3 blocks, 3/3, kvgeom 3 blocks, 3/3" in lines[9]
    assert lines[10].startswith("prefix hit: D holds 4096 tokens, pulls 1 more (in one 64 KiB block)")
    assert len(lines) == 18
    alone = render({"kvgeom": samples["kvgeom"]}, 4096, 3, "-", 2048).splitlines()
    assert alone[1].split() == ["kvgeom"] and alone[3].split()[-1] == "2.000"  # no nixl: no ratio column


def test_an_eager_read_posted_by_the_progress_thread_may_end_before_the_post_event() -> None:
    """An eager pull's READ goes out on the progress thread as soon as ``_start_pull`` queued it,
    and may be done before ``_start_pull`` returns (it learns a recipe after posting): posted is
    its ``post_part``'s end, and the row is kept."""
    events = [ev("engine", reqs=["d1"], t0=0.0, t1=0.5, cpu=0.1), ev("queued", t=0.0),
              ev("post", t0=1.0, t1=9.0, cpu=2.0, posted=True, tid="p1", blocks=1),
              ev("post_part", tid="p1", t0=2.0, t1=3.0, cpu=0.5), ev("done", t=4.0)]
    assert request_timings(events) == RequestTiming(overhead=9.0, overhead_cpu=2.5, queue_to_post=3.0, transfer=1.0,
                                                    blocks=1, engine_cpu=0.1)


# ---- the real classes ----------------------------------------------------------------------------


_REAL = r"""
import inspect, json, sys, tempfile
from benchmarks import vllm_timing
from kvgeom_nixl.vllm import executor, worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker
path = tempfile.mktemp()
vllm_timing.install_kvgeom(executor, path)
vllm_timing.install_kvgeom_engine(worker, path)
vllm_timing.install_nixl(pull_worker, path)
from kvgeom_nixl.transfer import Transfer
wrapped = {"ConnectorExecutor": (executor.ConnectorExecutor, ["pull", "_start_pull", "_d_finished"]),
           "Transfer": (Transfer, ["_post_to"]), "KvgeomWorker": (worker.KvgeomWorker, ["start_load_kv"]),
           "NixlPullConnectorWorker": (pull_worker.NixlPullConnectorWorker,
                                       ["_read_blocks_for_req", "_pop_done_transfers", "start_load_kv"])}
out = {}
for name, (cls, methods) in wrapped.items():
    for m in methods:
        f = getattr(cls, m)
        out[f"{name}.{m}"] = [bool(getattr(f, "_kvgeom_timed", False)),
                              list(inspect.signature(f.__wrapped__).parameters)]
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_the_hooks_wrap_the_real_classes_methods() -> None:
    """Under the vLLM venv: every method the hooks wrap exists on kvgeom's and vLLM's real
    classes, with the parameters the wrappers pass (a renamed method would fail the benchmark's
    instances at import, a changed signature its calls)."""
    from vllm_env import run_in_vllm

    got = run_in_vllm(_REAL)
    assert got == {
        "ConnectorExecutor.pull": [True, ["self", "job"]],
        "ConnectorExecutor._start_pull": [True, ["self", "job"]],
        "ConnectorExecutor._d_finished": [True, ["self", "ep"]],
        "Transfer._post_to": [True, ["self", "a", "notif_kind", "args"]],
        "KvgeomWorker.start_load_kv": [True, ["self", "meta"]],
        "NixlPullConnectorWorker._read_blocks_for_req": [True, ["self", "req_id", "meta"]],
        "NixlPullConnectorWorker._pop_done_transfers": [True, ["self", "transfers"]],
        "NixlPullConnectorWorker.start_load_kv": [True, ["self", "metadata"]],
    }, got
