"""Plan and check in one call: the planner's plan for a request, run through the reference simulator.

    verify(pair, request)  =  simulate(pair, request, plan_pair(pair, request),
                                       replan=plan_pair(pair, request))      planning twice checks determinism

It lives above both :mod:`kvgeom.planning` and :mod:`kvgeom.checking` because the simulator never
imports the planner: it is the oracle the planner is checked against.

Worked number: ``verify(pair, fresh_request(pair, 100))`` on the default preset returns a report
with ``ok`` true and 4 D ranks x their regions of bytes checked.
"""

from __future__ import annotations

from ..checking.report import Report
from ..checking.simulator import simulate
from ..planning.choose import Strategy
from ..planning.transfer import plan_pair
from ..values.pair import CheckedEngines
from ..values.request import Request

__all__ = ["verify"]


def verify(pair: CheckedEngines, request: Request, *, strategy: Strategy = "direct") -> Report:
    """Plan ``request`` twice and simulate the first plan (the second checks determinism)."""
    first = plan_pair(pair, request, strategy=strategy)
    second = plan_pair(pair, request, strategy=strategy)
    return simulate(pair, request, first, replan=second)
