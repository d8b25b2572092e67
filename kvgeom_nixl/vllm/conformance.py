"""A conformance run of vLLM's own NixlConnector on CPU, judged by kvgeom's kit and by the bytes.

    python -m kvgeom_nixl.vllm.conformance [--grid ci|amx|hybrid|layout|full] [--cell NAME ...] [--json]

For one cell (P and D block sizes, TP sizes, M, D's prefix hit S, layouts; docs/design.md §10.6):

    VllmSide(P), VllmSide(D)          vLLM's config, layers, KVCacheConfig, allocation, NixlConnector workers
    P's cache  <- known pattern       stale -3.0, then tokens [0, M) through the backend's own cache update
                                      (a hybrid: P's mamba state block through vLLM's own state views)
    D's cache  <- stale -7.0          and its prefix [0, S) written the same way (D's own hit)
    D.start_load_kv(metadata)         the metadata the scheduler builds for one request; the handshake
                                      over P's real side channel; READs over real NIXL (loopback UCX)
    D.get_transfer_results()          vLLM's receive step (block-size regroup, zeroing), recorded
    recorded dlists + READs + receive step --> kvgeom.conformance.check_connector     the kit's verdict
    D's cache vs vLLM's own writer         --> the byte check                         the independent verdict

Outcomes: ``REFUSED`` (vLLM raised or failed the request at the handshake or when posting, or
refused the engine's configuration), ``CONFORMS`` or ``WRONG`` (silently wrong bytes) from the
byte check, with the kit's verdict beside it (``kit``: ``CONFORMS`` / ``WRONG`` with its findings,
or ``UNDESCRIBABLE`` when a side cannot be described or two readings of it disagree). Models: a
tiny Llama on CPU_ATTN (float32, blocks of 32 k, LBHNC), a tiny DeepSeek-V2 on CPU_MLA (float32,
16-token blocks) or AMX_MLA (bfloat16, blocks of 32 k), and a tiny Nemotron-H (mamba2 + CPU_ATTN,
float32, TP1). D tokens past M in the last listed block are held to vLLM's contract
(``beyond_computed="any"``: attention masks by length); what they hold is reported separately.
Every receive step is also replayed from kvgeom's records onto D's cache before it and must give
the bytes vLLM left (``receive_replay``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .engines import STALE_D, STALE_P, TinyModel, VllmSide
from .judge import byte_check, kit_check
from .patterns import pattern, state_pattern
from .receive_step import ReceiveCall, replay_matches, watch_receive

__all__ = ["Cell", "CellResult", "run_cell", "GRIDS", "main"]

logger = logging.getLogger(__name__)

REQUEST = "req-conformance-0"
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Cell:
    """One P/D geometry and one request: M tokens computed on P, S of them already held by D."""

    p_block: int
    d_block: int
    m: int
    s: int = 0
    p_tp: int = 1
    d_tp: int = 1
    corrupt: str = ""  # a control: "shift" rewrites one recorded READ to a wrong remote block
    mla: bool = False  # the DeepSeek-shaped model on CPU_MLA (16-token blocks) instead of Llama on CPU_ATTN
    amx: bool = False  # with mla: AMX_MLA (bfloat16, blocks of any multiple of 32)
    hybrid: bool = False  # the Nemotron-H-shaped model: mamba2 state + CPU_ATTN attention
    p_layout: str = ""  # VLLM_KV_CACHE_LAYOUT asked for on P / D ("" lets vLLM choose: LBHNC here)
    d_layout: str = ""

    @property
    def name(self) -> str:
        extra = f" S={self.s}" if self.s else ""
        if self.p_layout or self.d_layout:
            extra += f" {self.p_layout or 'HND'}->{self.d_layout or 'HND'}"
        ctl = f" control:{self.corrupt}" if self.corrupt else ""
        kind = ("MLA-AMX " if self.amx else "MLA ") if self.mla else "HYBRID " if self.hybrid else ""
        return f"{kind}P{self.p_block}/tp{self.p_tp} -> D{self.d_block}/tp{self.d_tp} M={self.m}{extra}{ctl}"

    @property
    def model_key(self) -> str:
        return "hybrid" if self.hybrid else ("amx" if self.amx else "mla") if self.mla else "llama"


@dataclass
class CellResult:
    cell: str
    outcome: str  # REFUSED | CONFORMS | WRONG
    kit: str = ""  # CONFORMS | WRONG | UNDESCRIBABLE | "" (refused cells)
    kit_findings: dict[str, int] = field(default_factory=dict)
    kit_ignored: dict[str, int] = field(default_factory=dict)
    kit_lines: list[str] = field(default_factory=list)
    kit_where: list[tuple[str, str, str, int, int]] = field(default_factory=list)  # kind, side, group, layer, block
    kit_refusal: str = ""
    kit_receive: dict[str, int] = field(default_factory=dict)  # the receive step as the kit got it
    bytes: dict[str, Any] = field(default_factory=dict)
    refusal: str = ""
    reads: int = 0
    read_pairs: int = 0
    receive_steps: list[str] = field(default_factory=list)
    receive_replay: dict[str, Any] = field(default_factory=dict)  # kvgeom's steps vs what vLLM's receive did
    seconds: float = 0.0


def _blocks(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _corrupt(side: VllmSide, kind: str) -> None:
    """The control: point one READ pair of D rank 0 at the next remote descriptor of its table: the
    first pair of the first READ ("shift", an attention page), or the pair with the highest local id
    ("state": vLLM lists a hybrid's mamba descriptors after every attention page, the last being the
    ssm state of the last mamba layer, so the pair then reads the next state block's)."""
    agent = side.agent(0)
    reads = [p for p in agent.posted if p.op == "READ"]
    if not reads or kind not in ("shift", "state"):
        raise ValueError(f"cannot apply control {kind!r}: {len(reads)} READs recorded")
    read = reads[0] if kind == "shift" else max(reads, key=lambda p: int(p.local_ids.max()))
    j = 0 if kind == "shift" else int(read.local_ids.argmax())
    remote = agent.list_of(read.remote_handle)
    read.remote_ids[j] = (int(read.remote_ids[j]) + 1) % len(remote.descs)


def run_cell(cell: Cell, model: TinyModel, model_dir: Path, port: int) -> CellResult:
    """Run vLLM's connector for one cell and judge it (see the module docstring)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    start = time.perf_counter()
    result = CellResult(cell.name, "REFUSED")
    P = D = None
    try:
        try:
            P = VllmSide("P", model, model_dir, tp=cell.p_tp, block_size=cell.p_block,
                          num_blocks=_cdiv(MAX_MODEL_LEN, cell.p_block) + 8, port=port, kv_cache_layout=cell.p_layout)
            D = VllmSide("D", model, model_dir, tp=cell.d_tp, block_size=cell.d_block,
                          num_blocks=_cdiv(MAX_MODEL_LEN, cell.d_block) + 8, port=port + 1,
                          kv_cache_layout=cell.d_layout)
        except ValueError as e:  # vLLM refuses the engine's configuration (e.g. a layout its backend lacks)
            if not (cell.p_layout or cell.d_layout):
                raise
            result.refusal = f"engine config: {type(e).__name__}: {e}"
            return result
        n_p = _cdiv(cell.m, P.block_size)
        n_d = _cdiv(cell.m, D.block_size)
        held = cell.s // D.block_size
        p_blocks = _blocks(3, n_p)  # away from block 0 (vLLM's null block) and from the cache's ends
        d_all = _blocks(5, n_d)
        d_new = d_all[held:]
        # a hybrid's state: one block per request (mamba_cache_mode "none"), near the end of each cache
        p_state, d_state = P.num_blocks - 2, D.num_blocks - 3
        p_lists = [[p_state] if g.kind == "mamba" else p_blocks for g in P.groups()]
        d_lists = [[d_state] if g.kind == "mamba" else d_new for g in D.groups()]
        computed = tuple(0 if g.kind == "mamba" else held for g in D.groups())
        P.fill(STALE_P)
        D.fill(STALE_D)
        for r in range(P.tp):
            P.write_tokens(r, p_blocks, range(cell.m),
                           lambda i, t, plane, r=r: pattern(i, t, plane, P.heads(r), model.head_dim, model.kv_heads, model.torch_dtype))
            if model.hybrid:
                P.write_states(r, p_state, state_pattern)
        for r in range(D.tp):
            D.write_tokens(r, d_all, range(cell.s),
                           lambda i, t, plane, r=r: pattern(i, t, plane, D.heads(r), model.head_dim, model.kv_heads, model.torch_dtype))
        before = [{n: c.clone() for n, c in caches.items()} for caches in D.caches]
        P.register()
        D.register()
        handshake = [D.watch_handshake(r) for r in range(D.tp)]
        calls: list[ReceiveCall] = []
        for r in range(D.tp):
            watch_receive(D, r, calls)
        with set_current_vllm_config(P.config):
            for r in range(P.tp):
                meta = NixlConnectorMetadata()
                meta.reqs_to_send = {REQUEST: time.perf_counter() + 900}
                meta.reqs_in_batch = {REQUEST}
                P.worker(r).start_load_kv(meta)
        params = dict(remote_block_ids=tuple(p_lists), remote_engine_id="P", remote_request_id=REQUEST,
                      remote_host=P.scheduler.connector_scheduler.side_channel_host, remote_port=port,
                      tp_size=P.tp, remote_num_tokens=cell.m)
        errors: list[str] = []
        with set_current_vllm_config(D.config):
            for r in range(D.tp):
                meta = NixlConnectorMetadata()
                meta.add_new_req_to_recv(REQUEST, tuple(list(x) for x in d_lists), dict(params),
                                         local_num_computed_blocks=computed, awaiting_kvs=True)
                try:
                    D.worker(r).start_load_kv(meta)
                except Exception as e:  # vLLM's own refusal (e.g. an AssertionError) out of start_load_kv
                    errors.append(f"D rank {r} start_load_kv: {type(e).__name__}: {e}".strip())
            if not errors:
                errors += _finish(P, D, cell)
        if errors:
            errors = [e for errs in handshake for e in errs] + errors
        result.reads = sum(1 for r in range(D.tp) for p in D.agent(r).posted if p.op == "READ")
        result.read_pairs = sum(int(p.local_ids.size) for r in range(D.tp) for p in D.agent(r).posted)
        result.receive_steps = [str(c) for c in calls]
        if errors:
            result.refusal = "; ".join(errors)
            return result
        result.receive_replay = replay_matches(D, calls)  # before anything else writes D's cache
        if cell.corrupt:
            _corrupt(D, cell.corrupt)
            _replay(P, D)  # the corrupted READ really runs: the byte check must see it too
        judged = byte_check(D, before, cell, d_all, held, pattern, d_state=d_state if model.hybrid else None)
        result.bytes = judged
        result.outcome = "CONFORMS" if judged["ok"] else "WRONG"
        kit = kit_check(P, D, cell, p_lists, d_lists, calls)
        result.kit, result.kit_findings, result.kit_ignored = kit["verdict"], kit["counts"], kit["ignored"]
        result.kit_lines, result.kit_refusal, result.kit_receive = kit["lines"], kit["refusal"], kit["receive"]
        result.kit_where = kit["where"]
        return result
    except Exception as e:
        result.refusal = f"harness: {type(e).__name__}: {e}"
        logger.debug("cell %s failed:\n%s", cell.name, traceback.format_exc())
        result.outcome = "ERROR"
        return result
    finally:
        result.seconds = round(time.perf_counter() - start, 2)
        for side in (D, P):
            if side is not None:
                side.shutdown()


def _finish(P: VllmSide, D: VllmSide, cell: Cell, timeout_s: float = 60.0) -> list[str]:
    """Drive both sides' steps until every D rank has the request (or failed it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    done: set[int] = set()
    failed: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < D.tp and time.monotonic() < deadline:
        for r in range(D.tp):
            if r in done:
                continue
            worker = D.worker(r)
            try:
                worker.start_load_kv(NixlConnectorMetadata())
                res = worker.get_transfer_results()
            except Exception as e:
                failed.append(f"D rank {r}: {type(e).__name__}: {e}")
                done.add(r)
                continue
            if REQUEST in res.failed_recving:
                failed.append(f"D rank {r}: vLLM failed the request")
                done.add(r)
            elif REQUEST in res.finished_recving:
                done.add(r)
        for r in range(P.tp):
            P.worker(r).get_transfer_results()
        time.sleep(0.01)
    if len(done) < D.tp:
        failed.append(f"timed out after {timeout_s} s waiting for D")
    return failed


def _replay(P: VllmSide, D: VllmSide) -> None:
    """Post D rank 0's (corrupted) recorded READs again, for real, and wait for them."""
    agent = D.agent(0)
    for p in [p for p in agent.posted if p.op == "READ"]:
        handle = agent.make_prepped_xfer("READ", p.local_handle, p.local_ids, p.remote_handle, p.remote_ids)
        agent.transfer(handle)
        deadline = time.monotonic() + 30
        while agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
            for r in range(P.tp):
                P.agent(r).get_new_notifs()
            time.sleep(0.001)
        agent.release_xfer_handle(handle)
    agent.posted = agent.posted[: len(agent.posted) // 2]


# The grid. CPU_ATTN blocks are multiples of 32 (LBHNC only); CPU_MLA forces 16-token blocks,
# AMX_MLA (bfloat16) takes multiples of 32; the hybrid's attention block is vLLM's choice, 128, unless given.
CI_GRID = (
    Cell(32, 32, 100),
    Cell(32, 32, 100, s=32),
    Cell(32, 32, 150, s=64),
    Cell(32, 32, 100, p_tp=1, d_tp=2),
    Cell(32, 32, 100, p_tp=2, d_tp=1),
    Cell(64, 64, 100),
    Cell(32, 64, 128),
    Cell(32, 64, 150, s=64),
    Cell(64, 32, 100),
    Cell(32, 32, 100, corrupt="shift"),
    Cell(16, 16, 100, mla=True),
    Cell(16, 16, 100, s=32, mla=True),
    Cell(16, 16, 100, p_tp=1, d_tp=2, mla=True),
    Cell(16, 16, 100, corrupt="shift", mla=True),
    Cell(32, 64, 100, mla=True, amx=True),
    Cell(32, 64, 128, s=64, mla=True, amx=True),
    Cell(32, 64, 150, s=64, mla=True, amx=True),
    Cell(32, 128, 200),  # ratio 4 with a partly covered last D block: vLLM zeroes its tail
    Cell(32, 64, 100, p_tp=2, d_tp=1),  # different blocks and P TP > D TP: refused
    Cell(32, 32, 100, d_layout="NHD"),  # CPU_ATTN has no NHD: vLLM refuses the layout
    Cell(16, 16, 100, mla=True, d_layout="NHD"),
    Cell(128, 128, 100, hybrid=True),
    Cell(64, 128, 100, hybrid=True),
    Cell(128, 64, 100, hybrid=True),
    Cell(128, 128, 100, hybrid=True, corrupt="state"),
)
AMX_GRID = (
    Cell(32, 32, 100, mla=True, amx=True),
    Cell(32, 64, 100, mla=True, amx=True),
    Cell(32, 64, 128, s=64, mla=True, amx=True),
    Cell(32, 64, 150, s=64, mla=True, amx=True),
    Cell(32, 96, 200, s=96, mla=True, amx=True),
    Cell(64, 32, 100, mla=True, amx=True),
    Cell(32, 64, 100, p_tp=1, d_tp=2, mla=True, amx=True),
)
HYBRID_GRID = (
    Cell(128, 128, 100, hybrid=True),
    Cell(64, 128, 100, hybrid=True),
    Cell(128, 64, 100, hybrid=True),
    Cell(128, 128, 100, hybrid=True, corrupt="state"),
)
LAYOUT_GRID = (
    Cell(32, 32, 100, d_layout="NHD"),
    Cell(16, 16, 100, mla=True, d_layout="NHD"),
)
FULL_GRID = CI_GRID + tuple(c for c in AMX_GRID + HYBRID_GRID + LAYOUT_GRID if c not in CI_GRID) + (
    Cell(32, 32, 33),
    Cell(32, 64, 33),
    Cell(64, 128, 200),
    Cell(32, 128, 200),
    Cell(32, 64, 100, p_tp=2, d_tp=2),
    Cell(32, 64, 100, p_tp=2, d_tp=1),
    Cell(32, 32, 128),
    Cell(32, 32, 100, s=32, p_tp=2, d_tp=1),
    Cell(32, 64, 100),
    Cell(32, 96, 100),
    Cell(96, 96, 150),
    Cell(64, 64, 150, s=64),
    Cell(32, 64, 100, p_tp=1, d_tp=2),
    Cell(32, 64, 160, s=64),
    Cell(96, 32, 100),
    Cell(32, 32, 100, s=32, p_tp=1, d_tp=2),
    Cell(16, 16, 100, p_tp=2, d_tp=1, mla=True),
)
GRIDS = {"ci": CI_GRID, "amx": AMX_GRID, "hybrid": HYBRID_GRID, "layout": LAYOUT_GRID, "full": FULL_GRID}


def table(results: list[CellResult]) -> str:
    lines = ["| P -> D (block/tp), request | vLLM's connector | kvgeom's kit | findings |", "|---|---|---|---|"]
    for r in results:
        found = ", ".join(f"{k} x{n}" for k, n in r.kit_findings.items()) or r.kit_refusal or r.refusal
        lines.append(f"| {r.cell} | {r.outcome} | {r.kit or '-'} | {found[:160]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgeom_nixl.vllm.conformance", description=__doc__.split("\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="ci")
    ap.add_argument("--cell", action="append", default=[], help="only cells whose name contains this")
    ap.add_argument("--port", type=int, default=15700)
    ap.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = ap.parse_args(argv)
    cells = [c for c in GRIDS[args.grid] if not args.cell or any(s in c.name for s in args.cell)]
    models = {"llama": TinyModel(), "mla": TinyModel.deepseek(), "amx": TinyModel.deepseek(amx=True),
              "hybrid": TinyModel.nemotron_h()}
    results: list[CellResult] = []
    with tempfile.TemporaryDirectory(prefix="kvgeom-vllm-") as tmp:
        dirs = {key: m.write(Path(tmp) / f"tiny-{key}") for key, m in models.items()}
        for i, cell in enumerate(cells):
            res = run_cell(cell, models[cell.model_key], dirs[cell.model_key], args.port + 4 * i)
            results.append(res)
            print(f"{res.cell}: {res.outcome} (kit: {res.kit or '-'}) {res.refusal[:200]} [{res.seconds} s]",
                  file=sys.stderr, flush=True)
        controls = _controls(models["llama"], dirs["llama"], args.port + 4 * len(cells)) \
            if any(c.model_key in ("llama", "hybrid") for c in cells) else {}
    print(table(results), file=sys.stderr)
    if args.json:
        print(json.dumps({"cells": [asdict(r) for r in results], "controls": controls}))
    return 0


def _controls(model: TinyModel, model_dir: Path, port: int) -> dict[str, str]:
    """The description checks' controls on one CPU_ATTN side at block 64 (:func:`.describe.describe_controls`)."""
    from .describe import describe_controls

    side = VllmSide("C", model, model_dir, tp=1, block_size=64, num_blocks=16, port=port)
    try:
        side.register()
        return describe_controls(side)
    finally:
        side.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
