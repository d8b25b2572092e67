"""What every benchmark section shares: the measurement record, the run configuration, timing.

A measurement is one number next to the baseline it is judged against, in the same unit::

    Measurement(name="plan/llama3-70b-tp8-tp4/16384", value=0.131, unit="s",
                baseline=0.011, ratio=11.9, baseline_name="numpy writes the 7+4 output columns")

Timing: every timed callable runs ``repeats`` times, *interleaved* with the callables it is
compared with (a, b, a, b, ...), each after a ``gc.collect()``; the median of each is reported.
Interleaving keeps the ratio fair on a shared 2-core machine whose load changes during the run.

Worked number: medians 0.131 s (plan) and 0.011 s (lower bound) give ratio 0.131 / 0.011 = 11.9.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["Measurement", "Config", "Progress", "measurement", "interleaved_medians", "stderr_progress",
           "SECTIONS", "load_average", "thread_cpu_hook"]

SECTIONS: tuple[str, ...] = ("plan", "memory", "descriptors", "transfer", "receive", "packed")

Progress = Callable[[str], None]


def stderr_progress(line: str) -> None:
    """Progress lines go to stderr so that ``--json`` output on stdout stays machine-readable."""
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    pass


@attrs.frozen
class Measurement:
    """One result: ``value`` in ``unit`` against ``baseline`` (same unit); ``ratio = value / baseline``.

    ``goal`` states the target in words (``None`` where the issue sets none) and ``met`` whether
    this run reached it (``None`` when no goal applies at this size).
    """

    section: str
    name: str
    value: float
    unit: str
    baseline: float
    ratio: float
    baseline_name: str
    goal: str | None = None
    met: bool | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit, "baseline": self.baseline,
                "ratio": self.ratio, "section": self.section, "baseline_name": self.baseline_name,
                "goal": self.goal, "met": self.met, "note": self.note}


def measurement(section: str, name: str, value: float, unit: str, baseline: float, baseline_name: str, *,
                goal: str | None = None, met: bool | None = None, note: str = "") -> Measurement:
    """A :class:`Measurement` with its ratio computed (``value / baseline``; baseline must be > 0)."""
    if not baseline > 0:
        raise ValueError(f"{name}: baseline {baseline!r} must be positive to form a ratio")
    return Measurement(section, name, float(value), unit, float(baseline), float(value) / float(baseline),
                       baseline_name, goal, met, note)


@attrs.frozen
class Config:
    """Sizes and repeat counts of one run (:meth:`full` or :meth:`quick`; tests shrink further).

    Token counts are the request's computed tokens M; repeats are timed runs after one untimed
    warm-up. ``goal_tokens``: the smallest M at which the issue's planning goal applies.
    """

    quick: bool
    plan_tokens: tuple[int, ...]
    plan_repeats: int
    big_repeats: int  # repeats at >= big_tokens (the 128k runs take seconds each)
    big_tokens: int
    memory_tokens: int
    desc_tokens: int
    transfer_tokens: tuple[int, ...]
    transfer_layers: int
    transfer_repeats: int
    nixl_descs: int
    receive_tokens: int
    receive_layers: int
    receive_repeats: int
    plan_presets: tuple[str, ...]
    plan_synthetic: tuple[str, ...]
    desc_presets: tuple[str, ...]
    desc_synthetic: tuple[str, ...]
    packed_tokens: int = 16384
    packed_baseline_repeats: int = 3
    goal_tokens: int = 16384
    seed: int = 0

    @classmethod
    def full(cls) -> Config:
        return cls(
            quick=False,
            plan_tokens=(1024, 16384, 131072),
            plan_repeats=5,
            big_repeats=3,
            big_tokens=65536,
            memory_tokens=131072,
            desc_tokens=16384,
            transfer_tokens=(16384, 65536),
            transfer_layers=2,
            transfer_repeats=9,
            nixl_descs=16384,
            receive_tokens=16384,
            receive_layers=4,
            receive_repeats=5,
            plan_presets=PLAN_PRESETS,
            plan_synthetic=PLAN_SYNTHETIC,
            desc_presets=DESC_PRESETS,
            desc_synthetic=DESC_SYNTHETIC,
        )

    @classmethod
    def quick_config(cls) -> Config:
        return attrs.evolve(
            cls.full(),
            quick=True,
            plan_tokens=(1024, 4096),
            plan_repeats=3,
            big_repeats=2,
            memory_tokens=4096,
            desc_tokens=2048,
            transfer_tokens=(4096,),
            transfer_repeats=7,
            nixl_descs=4096,
            receive_tokens=2048,
            receive_layers=2,
            receive_repeats=3,
            packed_tokens=2048,
            packed_baseline_repeats=1,
        )

    def repeats_for(self, tokens: int) -> int:
        return self.big_repeats if tokens >= self.big_tokens else self.plan_repeats


PLAN_PRESETS = ("llama3-70b-tp8-tp4", "deepseek-v3-tp8-tp1", "kimi-linear-tp8-tp1", "qwen-swa-tp2-tp4",
                # topologies (docs/design.md §11) next to their one-stage neighbours
                "llama3-70b-tp4-tp8", "llama3-70b-pp2tp4-tp8", "deepseek-v3-tp8-dcp8", "kimi-linear-pp2tp4-tp1")
PLAN_SYNTHETIC = ("syn-tp1-tp1", "syn-tp4-tp1", "syn-tp2-tp4-k16-k32", "syn-nhd-hnd-staged")
DESC_PRESETS = ("llama3-70b-tp8-tp4", "llama3-70b-tp4-tp8", "deepseek-v3-tp8-tp1", "qwen-swa-tp2-tp4",
                "kimi-linear-tp8-tp1", "nemotron-h-tp1-tp4")
DESC_SYNTHETIC = ("syn-tp1-tp1", "syn-tp1-tp1-inner", "syn-tp2-tp4-inner", "syn-tp4-tp1", "syn-nhd-hnd-staged")


def interleaved_medians(funcs: dict[str, Callable[[], Any]], repeats: int,
                        prime: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median seconds of each callable over ``repeats`` interleaved rounds (results are dropped).

    ``prime``, when given, runs untimed before every timed call (and its result is dropped): e.g.
    allocating the outputs' sizes once, so that every callable finds the allocator in the same
    state instead of some paying for fresh pages and others not.
    """
    times: dict[str, list[float]] = {k: [] for k in funcs}
    for _ in range(max(1, repeats)):
        for key, fn in funcs.items():
            if prime is not None:
                primed = prime()
                del primed
            gc.collect()
            t0 = time.perf_counter()
            out = fn()
            times[key].append(time.perf_counter() - t0)
            del out
    return {k: statistics.median(v) for k, v in times.items()}


def thread_cpu_hook(owner: type, name: str, record: Callable[..., None]) -> Callable[[], None]:
    """Wrap method ``name`` of class ``owner`` so that every call also calls ``record(cpu_s, self,
    *args, **kwargs)`` with the thread CPU time it took (even when it raised); returns the undo. The
    connector benchmarks time the executor's own methods this way, on whichever thread runs them."""
    import functools

    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            record(time.thread_time() - c0, self, *args, **kwargs)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def geomean(values: Sequence[float]) -> float:
    import math

    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


quiet = _quiet
