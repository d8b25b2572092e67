"""The command line's limits: the budget flags, and the memory and step guards of a run.

Every command that plans, simulates or allocates takes ``--budget-mb``, ``--max-work`` and
``--max-steps`` (the three limits of :class:`~kvgeom.PlanBudget`, docs/design.md §14), and is
refused (:class:`~kvgeom.PlanBudgetExceeded`, exit 2) before it allocates beyond them. Worked
number: the simulation of a pair allocates P's memory and three times D's (D's bytes, the
expected bytes and the masks), so a 1 GiB P and a 2 GiB D need 7 GiB, over a ``--budget-mb 4096``.
"""

from __future__ import annotations

import argparse
import os

from ..errors import PlanBudgetExceeded
from ..planning.budget import DEFAULT_BUDGET, PlanBudget
from ..planning.transfer import Pair
from ..values.engine import EngineGeometry

__all__ = ["budget_arguments", "budget_of", "budget_mb", "count", "machine_bytes", "check_memory", "mib_above",
           "engine_bytes", "simulation_bytes", "simulation_steps", "check_simulation"]


def budget_mb(text: str) -> int:
    """``--budget-mb``: a whole number of MiB >= 1 (argparse reports anything else as a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None
    if not 1 <= value <= 1 << 30:
        raise argparse.ArgumentTypeError(f"{value} MiB is outside 1 .. {1 << 30}")
    return value


def count(text: str) -> int:
    """``--max-work`` / ``--max-steps``: a whole number >= 1 (argparse reports anything else, exit 2)."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 1 << 62:
        raise argparse.ArgumentTypeError(f"{value} is outside 1 .. {1 << 62}")
    return value


def budget_arguments(p: argparse.ArgumentParser) -> None:
    """The three limits of :class:`~kvgeom.PlanBudget`, one flag each."""
    p.add_argument("--budget-mb", type=budget_mb, default=DEFAULT_BUDGET.max_bytes >> 20, metavar="MB",
                   help=f"refuse (exit 2) a request whose plan, simulation or caches would need more memory "
                        f"(PlanBudget.max_bytes; default {DEFAULT_BUDGET.max_bytes >> 20})")
    p.add_argument("--max-work", type=count, default=DEFAULT_BUDGET.max_work, metavar="N",
                   help=f"refuse a plan of more row operations (PlanBudget.max_work; default {DEFAULT_BUDGET.max_work})")
    p.add_argument("--max-steps", type=count, default=DEFAULT_BUDGET.max_steps, metavar="N",
                   help="refuse a plan or simulation of more Python-level steps (PlanBudget.max_steps; default "
                        f"{DEFAULT_BUDGET.max_steps})")


def budget_of(args: argparse.Namespace) -> PlanBudget:
    """The :class:`~kvgeom.PlanBudget` of ``--budget-mb``, ``--max-work`` and ``--max-steps``."""
    return PlanBudget(max_bytes=args.budget_mb << 20, max_work=args.max_work, max_steps=args.max_steps)


def machine_bytes() -> int | None:
    """This machine's physical memory in bytes (``None`` where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(what: str, nbytes: int, budget: PlanBudget, fix: str) -> None:
    """Refuse (PlanBudgetExceeded, exit 2) to allocate ``nbytes`` beyond the budget's memory. Raising
    the budget is suggested only when the allocation would fit this machine's memory."""
    if nbytes > budget.max_bytes:
        have = machine_bytes()
        if have is not None and nbytes > have:
            raise_it = f" (more than this machine's {have / 2**30:.1f} GiB of memory: raising --budget-mb will not help)"
        else:
            raise_it = f", or raise the budget with --budget-mb {mib_above(nbytes)}"
        raise PlanBudgetExceeded(what, f"the {what} would allocate {nbytes:,} B ({nbytes / 2**30:.2f} GiB), beyond "
                                 f"the budget of {budget.max_bytes:,} B", actual=nbytes,
                                 expected=f"<= {budget.max_bytes}", fix=f"{fix}{raise_it}")


def mib_above(nbytes: int) -> int:
    return max(1, -(-nbytes // 2**20))


def engine_bytes(engine: EngineGeometry) -> int:
    return engine.total_bytes


def simulation_bytes(pair: Pair) -> int:
    """What ``simulate`` allocates for a pair: P's memory, D's memory and D's expected bytes (plus masks)."""
    return engine_bytes(pair.prefill) + 3 * engine_bytes(pair.decode)


def simulation_steps(pair: Pair) -> int:
    """A lower bound of the simulator's Python-level steps: it fills and checks every (rank, layer, plane)."""
    layers = sum(g.num_layers for g in pair.model.groups)
    return 2 * layers * (pair.prefill.num_ranks + pair.decode.num_ranks)


def check_simulation(pair: Pair, budget: PlanBudget, fix: str) -> None:
    """Refuse a simulation (or a local deployment's caches and check) beyond the budget's memory or steps."""
    check_memory("simulation", simulation_bytes(pair), budget, fix)
    steps = simulation_steps(pair)
    if steps > budget.max_steps:
        raise PlanBudgetExceeded("simulation", f"the simulation would take at least {steps:,} steps (ranks x "
                                 f"layers x planes), beyond the budget of {budget.max_steps:,}", actual=steps,
                                 expected=f"<= {budget.max_steps}",
                                 fix=f"{fix} (an engine of {pair.prefill.num_ranks} and one of {pair.decode.num_ranks} "
                                     f"ranks are hardly real), or raise the budget with --max-steps {steps}")
