"""Hypothesis strategies for models, engine geometries, engine pairs and requests (``kvgeom[testing]``).

Importing :mod:`kvgeom` never imports hypothesis; only ``import kvgeom.tools.strategies`` does. The
strategies build the same values a connector builds (:meth:`EngineGeometry.build`, :class:`Request`),
so a connector's own test can fuzz its transfers against the reference simulator::

    from hypothesis import given
    from kvgeom import Pair, strategies as kst
    from kvgeom.checking.simulator import simulate

    @given(kst.transfers())
    def test_my_connector(t):
        plan = my_connector_plan(t.pair.prefill, t.pair.decode, t.request)
        report = simulate(Pair(*t.pair), t.request, plan)
        if not report.ok:  # the report names every violation
            raise AssertionError(str(report))

Draw order follows the shrinking advice of hypothesis' docs: shared facts first (the model), then
each side's TP, kernel page, logical block and layout, then the request (its length first, then
the prefix hit, then the block ids)::

    models() ---> engines(model) x 2 ---> pairs() / unpairable_pairs()
                                              \\---> requests(pair) ---> transfers()

Every choice shrinks towards the first option (``kinds[0]``, ``kernel_tokens[0]``, TP 1, one layer,
one head, consecutive block ids from 0, no prefix hit), so a failure shrinks to a small geometry.

Worked number: engines sized for ``max_tokens=64`` with K = 4 and ppl = 2 (B = 8 tokens per
logical block) and one full-attention group get ``ceil(64 / 8) + 1 = 9`` blocks for the longest
request plus 1 to 4 spare ones, so requests always fit and there are neighbours in use.

This module is the public import path (``from kvgeom.tools import strategies as kst``) and
re-exports every strategy: the models and engines are drawn in
:mod:`kvgeom.tools.engine_strategies`, the requests in :mod:`kvgeom.tools.request_strategies`, the
pairs and transfers in :mod:`kvgeom.tools.pair_strategies`.
"""

from __future__ import annotations

from .engine_strategies import KINDS as KINDS
from .engine_strategies import KV as KV
from .engine_strategies import LAYOUTS as LAYOUTS
from .engine_strategies import MAX_EXTRA_STATES as MAX_EXTRA_STATES
from .engine_strategies import REGIONS as REGIONS
from .engine_strategies import STATE_LAYOUTS as STATE_LAYOUTS
from .engine_strategies import blocks_for, engines, hybrid_rule_ppl, models, valid_dcps, valid_tps
from .pair_strategies import (
    MISMATCHES,
    DrawnPair,
    PackedTransfer,
    Transfer,
    packed_transfers,
    pairs,
    transfers,
    unpairable_pairs,
)
from .request_strategies import requests

__all__ = [
    "DrawnPair",
    "Transfer",
    "MISMATCHES",
    "models",
    "engines",
    "pairs",
    "unpairable_pairs",
    "requests",
    "transfers",
    "PackedTransfer",
    "packed_transfers",
    "blocks_for",
    "valid_tps",
    "hybrid_rule_ppl",
    "valid_dcps",
]
