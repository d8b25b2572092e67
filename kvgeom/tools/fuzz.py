"""``kvgeom fuzz``: the planner against the reference simulator on hypothesis-drawn pairs and requests.

    kvgeom fuzz [--examples N] [--seed S] [--strategy direct|staged|auto|all] [--max-tokens M]
                [--mismatch-probability P] [--topology-probability P] [--out FILE] [--no-progress]
                [--budget-mb MB] [--max-work N] [--max-steps N]

One example is one :func:`kvgeom.tools.strategies.transfers` draw (a pair, sometimes unpairable, and a
request) checked with every chosen strategy::

    draw (pair, request) --> pairable(P, D)? --no--> planner must raise IncompatibleGeometry with
                                 |                   the same first reason path   -> "rejected"
                                 yes
                                 v
                 plan twice per strategy --> simulate(pair, request, plan, replan=second plan)
                                 |                     zero violations          -> "verified"
                                 v
                 over the budget (PlanBudgetExceeded)   -> "refused" (counted per strategy
                                 |                       and limit; not a failure)
                 anything else (violation, crash, wrong rejection) -> hypothesis shrinks it and the
                 minimal pair + request are printed as a pair file (`kvgeom plan --pair FILE`), exit 1

Distinct failures (by outcome, strategy and first violation kind or exception type) are shrunk
separately. The progress line on stderr shows examples done, rejected pairs and violations. About
``--topology-probability`` of each side's engines get pipeline stages, DCP token shards or
replicas (docs/design.md §11); the summary counts the pairs with one on either side.

Worked number: ``--examples 100000 --strategy all`` checks up to 300,000 plans (plans equal to one
already verified for the same request, e.g. ``auto``'s pick, are not simulated twice). On the 2-core
project machine that run took 26 min 40 s: 62.6 examples/s, 172 MB peak memory (hypothesis runs in
chunks of 5,000 examples so its memory stays flat).
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

from ..checking.report import Report
from ..checking.simulator import simulate
from ..errors import IncompatibleGeometry, PlanBudgetExceeded, PlanError
from ..planning.budget import DEFAULT_BUDGET, PlanBudget
from ..planning.choose import STRATEGIES
from ..planning.packed import min_staging_bytes
from ..planning.transfer import Pair, plan_transfer
from ..values.pair import pairable
from ..values.request import Request
from ..values.text import text_table
from . import strategies as kst

__all__ = [
    "Outcome",
    "FuzzResult",
    "Failure",
    "FuzzFailure",
    "check_transfer",
    "chunked_capacity",
    "fuzz",
    "run_fuzz",
    "reason_key",
]

CHUNK_EXAMPLES = 5000  # examples per hypothesis run (see fuzz())
FAILURE_KINDS = ("violation", "crash", "wrong_rejection", "reason_mismatch", "accepted_unpairable")


@attrs.frozen
class Outcome:
    """What one example gave: ``kind`` is ``verified``, ``rejected`` or one of :data:`FAILURE_KINDS`."""

    kind: str
    plans: int = 0  # plans the simulator verified
    strategy: str | None = None  # the strategy that failed
    reason: str | None = None  # the rejection's path (rejected) or the expected path (reason_mismatch)
    report: Report | None = None  # the simulator's report (violation)
    error: str | None = None  # "Type: message" (crash, wrong_rejection, reason_mismatch)
    where: str | None = None  # "plan" or "simulate" (crash)
    staging_bytes: int | None = None  # the packed strategy's capacity when it was not the default
    refused: tuple[str, ...] = ()  # "strategy: limit" per plan refused over the budget (PlanBudgetExceeded)

    @property
    def failed(self) -> bool:
        return self.kind in FAILURE_KINDS

    def signature(self) -> str:
        """What tells two failures apart (hypothesis shrinks each signature separately)."""
        if self.kind == "violation" and self.report is not None:
            first = next((k.value for k, n in self.report.counts.items() if n), "?")
            return f"violation-{self.strategy}-{first}"
        if self.kind == "crash":
            return f"crash-{self.where}-{self.strategy}-{(self.error or '').split(':')[0]}"
        return f"{self.kind}-{self.strategy}"

    def describe(self) -> str:
        capacity = f" --staging-bytes {self.staging_bytes}" if self.staging_bytes is not None else ""
        if self.kind == "violation" and self.report is not None:
            return f"strategy {self.strategy}{capacity}: the simulator found violations\n{self.report}"
        if self.kind == "crash":
            return f"strategy {self.strategy}{capacity}: {self.where} raised {self.error}"
        if self.kind == "wrong_rejection":
            return f"strategy {self.strategy}: pairable() says ok but the planner raised {self.error}"
        if self.kind == "reason_mismatch":
            return f"strategy {self.strategy}: the planner's first reason ({self.error}) is not pairable()'s ({self.reason})"
        if self.kind == "accepted_unpairable":
            return f"strategy {self.strategy}: pairable() says no ({self.reason}) but the planner returned a plan"
        return self.kind


def reason_key(path: str) -> str:
    """A rejection path with group indexes and names folded: ``decode.model.groups[*].head_bytes``."""
    return re.sub(r"groups\[\d+\](\([^)]*\))?", "groups[*]", path)


def chunked_capacity(plan: Any, minimum: int) -> int:
    """A staging capacity that cuts ``plan`` (a packed plan) into about three chunks, and never below
    ``minimum`` (the smallest the planner accepts): a third of its busiest rank's staging."""
    used = int(max(plan.staging_used("prefill").max(initial=0), plan.staging_used("decode").max(initial=0)))
    return max(minimum, used // 3, 1)


def check_transfer(prefill: Any, decode: Any, request: Request, strategies: tuple[str, ...] = STRATEGIES, *,
                   budget: PlanBudget | None = DEFAULT_BUDGET) -> Outcome:
    """The fuzz property for one pair and request: a typed rejection that agrees with
    :func:`kvgeom.pairable`, or, for every strategy, a deterministic plan with zero violations.
    ``packed`` is checked twice: with the default staging capacity and with a third of the first
    plan's busiest staging (:func:`chunked_capacity`), so chunks and token-range pieces are drawn too.

    A plan refused over ``budget`` (:class:`~kvgeom.errors.PlanBudgetExceeded`, the planner's
    documented answer to a request too large for it) is a refusal, not a failure: it is counted in
    ``Outcome.refused`` and the other strategies are still checked; ``refused`` is the outcome when
    no strategy planned at all."""
    compat = pairable(prefill, decode)
    verified = 0
    refused: list[str] = []
    passed: list[Any] = []  # plans the simulator already verified for this request
    runs: list[tuple[str, int | None]] = [(s, None) for s in strategies]
    i = 0
    while i < len(runs):
        strategy, capacity = runs[i]
        i += 1
        extra: dict[str, Any] = {"budget": budget} if capacity is None else {"staging_bytes": capacity,
                                                                               "budget": budget}
        try:
            plan = plan_transfer(prefill, decode, request, strategy=strategy, **extra)  # type: ignore[arg-type]
            replan = plan_transfer(prefill, decode, request, strategy=strategy, **extra)  # type: ignore[arg-type]
        except PlanBudgetExceeded as e:
            if not compat.ok:  # an unpairable pair is refused as such before anything is estimated
                return Outcome("reason_mismatch", verified, strategy, reason=compat.reasons[0].path, error=e.path)
            limit = str(e.expected).split(" ")[0] if e.expected is not None else e.path
            refused.append(f"{strategy}: {limit}")
            continue
        except IncompatibleGeometry as e:
            if compat.ok:
                return Outcome("wrong_rejection", verified, strategy, error=f"{type(e).__name__}: {e}")
            first = compat.reasons[0].path
            if e.path != first:
                return Outcome("reason_mismatch", verified, strategy, reason=first, error=e.path)
            return Outcome("rejected", verified, reason=e.path)
        except PlanError as e:
            return Outcome("crash", verified, strategy, error=f"{type(e).__name__}: {e}", where="plan",
                           staging_bytes=capacity)
        except Exception as e:  # noqa: BLE001 - any other exception is a finding
            return Outcome("crash", verified, strategy, error=f"{type(e).__name__}: {e}", where="plan",
                           staging_bytes=capacity)
        if not compat.ok:
            return Outcome("accepted_unpairable", verified, strategy, reason=compat.reasons[0].path)
        if strategy == "packed" and capacity is None and plan.packed:
            runs.append(("packed", chunked_capacity(plan, min_staging_bytes(Pair(prefill, decode), request))))
        if plan == replan and any(plan == seen for seen in passed):
            verified += 1  # the same rows as a verified plan (auto picks one, staged may fall back to direct)
            continue
        try:
            report = simulate(Pair(prefill, decode), request, plan, replan=replan)
        except Exception as e:  # noqa: BLE001
            return Outcome("crash", verified, strategy, error=f"{type(e).__name__}: {e}", where="simulate",
                           staging_bytes=capacity)
        if not report.ok:
            return Outcome("violation", verified, strategy, report=report, staging_bytes=capacity,
                           refused=tuple(refused))
        passed.append(plan)
        verified += 1
    return Outcome("verified" if verified or not refused else "refused", verified, refused=tuple(refused))


# ---- the run -------------------------------------------------------------------------------------------


@attrs.define
class Failure:
    """A (shrunk) failing example and what went wrong."""

    outcome: Outcome
    transfer: kst.Transfer

    def reproducer(self) -> str:
        """The pair file (JSON) ``kvgeom plan --pair FILE`` reads."""
        from .serialize import dump_pair_file

        return dump_pair_file(self.transfer.pair, self.transfer.request)  # type: ignore[arg-type]


@attrs.define
class FuzzResult:
    """Counts of one run and its failures (minimal examples, one per signature)."""

    examples: int = 0  # examples drawn before the first failure (generation phase)
    shrink_steps: int = 0  # examples run while shrinking
    rejected: int = 0
    verified_pairs: int = 0
    plans_verified: int = 0
    plans_refused: int = 0  # plans refused over the budget (PlanBudgetExceeded): not failures
    refused_pairs: int = 0  # pairs where no strategy planned within the budget
    refusals: collections.Counter[str] = attrs.field(factory=collections.Counter)  # "strategy: limit" -> count
    topology_pairs: int = 0  # examples with stages, DCP or replicas on either side
    reasons: collections.Counter[str] = attrs.field(factory=collections.Counter)
    failures: dict[str, Failure] = attrs.field(factory=dict)
    seconds: float = 0.0  # the generation phase (until the first failure)
    shrink_seconds: float = 0.0  # shrinking the failures, after it
    seed: int = 0
    strategies: tuple[str, ...] = STRATEGIES

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def rate(self) -> float:
        """Examples per second over the generation phase."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        rows: list[list[Any]] = [
            ["pairs tried", self.examples],
            ["pairs rejected (unpairable)", self.rejected],
            ["pairs verified", self.verified_pairs],
            ["plans verified", self.plans_verified],
            ["plans refused over the budget", self.plans_refused],
            ["failures (distinct, shrunk)", len(self.failures)],
            ["pairs with stages, DCP or replicas", self.topology_pairs],
        ]
        took = f"{self.seconds:.1f} s ({self.rate:.1f} examples/s)"
        if self.shrink_steps:
            took = (f"{self.seconds + self.shrink_seconds:.1f} s in all: {self.seconds:.1f} s drawing "
                    f"({self.rate:.1f} examples/s), {self.shrink_seconds:.1f} s shrinking")
        out = [f"kvgeom fuzz: {self.examples} examples, seed {self.seed}, strategies {', '.join(self.strategies)}: "
               f"{took}", text_table(rows)]
        if self.reasons:
            out.append("rejections by reason:")
            out.append(text_table([[k, n] for k, n in sorted(self.reasons.items(), key=lambda kv: (-kv[1], kv[0]))]))
        if self.refusals:
            out.append("budget refusals by strategy and limit (PlanBudgetExceeded; not failures; raise the budget "
                       "with --budget-mb, --max-work, --max-steps):")
            out.append(text_table([[k, n] for k, n in sorted(self.refusals.items(), key=lambda kv: (-kv[1], kv[0]))]))
        if self.shrink_steps:
            out.append(f"shrinking ran {self.shrink_steps} more examples in {self.shrink_seconds:.1f} s")
        return "\n".join(out)


class _Progress:
    """One plain-text status line on ``stream``: redrawn with \\r at most 10 times a second on a
    terminal, a full line every 15 s otherwise."""

    def __init__(self, stream: TextIO, total: int, enabled: bool) -> None:
        self.stream = stream
        self.total = total
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.last = 0.0
        self.width = 0

    def update(self, r: FuzzResult, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < (0.1 if self.tty else 15.0):
            return
        self.last = now
        elapsed = now - self.start
        rate = r.examples / elapsed if elapsed > 0 else 0.0
        if r.failures or r.shrink_steps:
            text = (f"fuzz: {r.examples} examples, {len(r.failures) or 1} failure(s): shrinking "
                    f"({r.shrink_steps} steps)")
        else:
            left = (self.total - r.examples) / rate if rate > 0 else 0.0
            text = (f"fuzz: {r.examples}/{self.total} examples  rejected {r.rejected}  "
                    f"plans verified {r.plans_verified}  violations 0  {rate:.1f}/s  eta {left:.0f} s")
        if self.tty:
            pad = max(0, self.width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


class FuzzFailure(AssertionError):
    """Raised inside the hypothesis test for a failing example; subclassed per signature."""


_FAILURE_TYPES: dict[str, type[FuzzFailure]] = {}


def _failure_type(signature: str) -> type[FuzzFailure]:
    """One exception class per signature, so hypothesis shrinks distinct failures separately."""
    if signature not in _FAILURE_TYPES:
        name = "Fuzz_" + re.sub(r"\W", "_", signature)
        _FAILURE_TYPES[signature] = type(name, (FuzzFailure,), {})
    return _FAILURE_TYPES[signature]


def fuzz(
    examples: int = 1000,
    *,
    seed: int | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    max_tokens: int = 64,
    mismatch_probability: float = 0.1,
    progress: TextIO | None = None,
    transfers: Any = None,
    topology_probability: float = 0.3,
    budget: PlanBudget | None = DEFAULT_BUDGET,
) -> FuzzResult:
    """Run the fuzz property on ``examples`` hypothesis examples and return the counts and the
    shrunk failures (empty when every example passed).

    ``transfers`` replaces the default :func:`kvgeom.tools.strategies.transfers` draw (whose pairs use
    ``max_tokens`` and ``mismatch_probability``), e.g. to fuzz wider geometries. ``budget`` is
    every plan's :class:`~kvgeom.PlanBudget`; plans beyond it are counted as refusals.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    result = FuzzResult(seed=seed, strategies=strategies)
    bar = _Progress(progress or sys.stderr, examples, progress is not None)
    strategy = transfers if transfers is not None else kst.transfers(
        pairs=kst.pairs(mismatch_probability=mismatch_probability, max_tokens=max_tokens,
                        topology_probability=topology_probability), max_tokens=max_tokens)
    start = time.monotonic()
    shrinking = False

    def run_chunk(chunk_examples: int, chunk_seed: int) -> None:
        @hypothesis_seed(chunk_seed)
        @settings(database=None, derandomize=False, max_examples=chunk_examples, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink),
                  verbosity=Verbosity.quiet, print_blob=False, report_multiple_bugs=True)
        @given(strategy)
        def property_(t: kst.Transfer) -> None:
            nonlocal shrinking
            outcome = check_transfer(t.pair.prefill, t.pair.decode, t.request, strategies, budget=budget)
            if shrinking:
                result.shrink_steps += 1
            else:
                result.examples += 1
                result.plans_verified += outcome.plans
                if not (t.pair.prefill.topology.trivial and t.pair.decode.topology.trivial):
                    result.topology_pairs += 1
                if outcome.kind == "rejected":
                    result.rejected += 1
                    result.reasons[reason_key(outcome.reason or "?")] += 1
                elif outcome.kind == "verified":
                    result.verified_pairs += 1
                elif outcome.kind == "refused":
                    result.refused_pairs += 1
                result.plans_refused += len(outcome.refused)
                result.refusals.update(outcome.refused)
            if outcome.failed:
                if not shrinking:
                    shrinking = True
                    result.seconds = time.monotonic() - start
                sig = outcome.signature()
                result.failures[sig] = Failure(outcome, t)  # a signature's last call is hypothesis' minimal replay
                bar.update(result)
                raise _failure_type(sig)(outcome.describe())
            bar.update(result)

        try:
            property_()
        except FuzzFailure:
            pass
        except BaseException as e:  # an ExceptionGroup of FuzzFailures when several distinct failures were found
            subs = getattr(e, "exceptions", None)
            if subs is None or not all(isinstance(s, FuzzFailure) for s in subs):
                raise

    # Hypothesis keeps a tree of every example it ran; chunks of CHUNK_EXAMPLES (each with its own
    # seed derived from ``seed``) keep that memory, and the time per example, flat on long runs.
    chunk = 0
    try:
        while result.examples < examples and not shrinking:
            before = result.examples
            chunk_seed = seed if chunk == 0 else (seed + chunk * 0x9E3779B1) % 2**32
            run_chunk(min(CHUNK_EXAMPLES, examples - result.examples), chunk_seed)
            chunk += 1
            if result.examples == before:  # hypothesis found nothing new to try
                break
    finally:
        bar.close()
    if not shrinking:
        result.seconds = time.monotonic() - start
    else:
        result.shrink_seconds = time.monotonic() - start - result.seconds
    return result


# ---- the subcommand ------------------------------------------------------------------------------------


def _out_path(base: str, i: int) -> Path:
    p = Path(base)
    return p if i == 0 else p.with_name(f"{p.stem}-{i + 1}{p.suffix}")


def run_fuzz(args: argparse.Namespace) -> int:
    """Run ``kvgeom fuzz`` (its arguments are declared in :mod:`kvgeom.tools.cli`); 0 when every example passed, 1 when a failure was found, 2 on bad arguments."""
    if args.examples < 1:
        print(f"kvgeom fuzz: error: --examples {args.examples}: must be >= 1", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print(f"kvgeom fuzz: error: --max-tokens {args.max_tokens}: must be >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.mismatch_probability <= 1.0:
        print(f"kvgeom fuzz: error: --mismatch-probability {args.mismatch_probability}: must be in [0, 1]",
              file=sys.stderr)
        return 2
    if not 0.0 <= args.topology_probability <= 1.0:
        print(f"kvgeom fuzz: error: --topology-probability {args.topology_probability}: must be in [0, 1]",
              file=sys.stderr)
        return 2
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    result = fuzz(args.examples, seed=args.seed, strategies=strategies, max_tokens=args.max_tokens,
                  mismatch_probability=args.mismatch_probability, topology_probability=args.topology_probability,
                  progress=None if args.no_progress else sys.stderr,
                  budget=PlanBudget(max_bytes=args.budget_mb << 20, max_work=args.max_work, max_steps=args.max_steps))
    print(result.summary())
    for i, (sig, failure) in enumerate(sorted(result.failures.items())):
        print(f"\nFAILURE {i + 1} of {len(result.failures)} ({sig}): {failure.outcome.describe()}")
        strategy = failure.outcome.strategy or "direct"
        if failure.outcome.staging_bytes is not None:
            strategy += f" --staging-bytes {failure.outcome.staging_bytes}"
        text = failure.reproducer()
        if args.out:  # the file holds the reproducer; stdout only says where
            path = _out_path(args.out, i)
            path.write_text(text, encoding="utf-8")
            print(f"reproducer written to {path}: kvgeom plan --pair {path} --strategy {strategy}")
        else:
            print(f"reproducer (save as repro.json, then: kvgeom plan --pair repro.json --strategy {strategy}):")
            print(text, end="")
    if result.failures:
        print(f"\nkvgeom fuzz: {len(result.failures)} failure(s); rerun with --seed {result.seed}")
        return 1
    return 0

