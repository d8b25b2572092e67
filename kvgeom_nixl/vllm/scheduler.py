"""The scheduler side of ``KvgeomConnector`` (docs/design.md §15.2): which tokens D loads, and P's delayed frees.

It runs in vLLM's scheduler process and plans nothing: it only decides, from the request's
``kv_transfer_params`` (the fields vLLM's P/D proxies already pass), what D pulls and what P keeps,
and hands that to the workers in :class:`KvgeomMetadataFields`. The workers plan with kvgeom.

vLLM's calls, in the order a request sees them (``vllm.distributed.kv_transfer.kv_connector.v1.base``):

* ``on_new_request(request)``: on P, a mamba hybrid's ``do_remote_decode`` request loses its last
  prompt token (P prefills N - 1 tokens and samples nothing D uses): a recurrent state cannot be
  rewound, so D must receive the state after N - 1 tokens and compute token N itself, as it
  recomputes the last token of any request it loads. vLLM's NixlConnector does the same, so P's
  ``remote_num_tokens`` is N - 1 with either connector.
* ``get_num_new_matched_tokens(request, S)`` on D, where S is D's local prefix-cache hit (vLLM
  presents it in whole blocks): a request with ``do_remote_prefill`` and P's fields can load
  ``min(remote_num_tokens, prompt) - S`` tokens, asynchronously (``True``). D pulls only what it
  does not hold; vLLM recomputes the last prompt token itself to sample (a mamba hybrid loads at
  most N - 1 tokens: the state after token N would be advanced twice).
* ``get_loaded_kv_cache_group_ids(request)``: every KV-cache group (a mamba group's state block
  arrives with the attention blocks, so vLLM must not zero it after allocation).
* ``update_state_after_alloc(request, blocks, n)``: D's blocks are allocated; the blocks without a
  hash (the ones the prefix cache did not supply, vLLM's null padding skipped) receive tokens
  ``[S, S + n)``. ``n == 0`` (a full local hit) pulls nothing but still releases P. Either way
  ``do_remote_prefill`` is cleared: one transfer per request (vLLM may call this twice).
* ``build_connector_meta(scheduler_output)``: everything decided since the last step, for the workers.
* ``request_finished(request, block_ids)`` / ``request_finished_all_groups`` (hybrid models, one
  list per KV-cache group) on P: a finished ``do_remote_decode`` request keeps its blocks (``True``)
  until the workers report it in ``finished_sending`` (every D rank released it, or
  ``kv_lease_duration`` passed), and returns the params D needs, in the fields of vLLM's
  NixlConnector. On D, a request finished before its blocks were allocated (aborted) releases P
  without a pull.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvgeom import value_text
from kvgeom_nixl.errors import ExecutorError
from kvgeom_nixl.protocol import MAX_ID

__all__ = ["Pull", "Release", "KvgeomMetadataFields", "KvgeomScheduler", "DEFAULT_PORT", "DEFAULT_LEASE_S",
           "MAX_REMOTE_IDS", "MAX_REMOTE_GROUPS"]

DEFAULT_PORT = 5700  # KVGEOM_SIDE_CHANNEL_PORT (or extra config side_channel_port): rank r listens on port + r
DEFAULT_LEASE_S = 120.0  # kv_connector_extra_config["kv_lease_duration"]
REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
MAX_REMOTE_IDS = 1 << 20  # block ids one request's remote_block_ids may hold, all groups together
MAX_REMOTE_GROUPS = 256  # lists in remote_block_ids
_MAX_BLOCK_ID = (1 << 31) - 1
_MAX_TOKENS = (1 << 31) - 1
_MAX_TP = 4096
_MAX_HOST = 255  # characters of remote_host (a DNS name's limit)
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Release:
    """Tell P's ranks that D is done with P's request ``remote_request_id`` (no pull, or after one)."""

    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp: int


@dataclass(frozen=True)
class Pull:
    """One D request to pull: D's blocks for tokens [prefix_hit_tokens, computed_tokens), P's from 0."""

    request_id: str
    local_blocks: tuple[tuple[int, ...], ...]
    remote_blocks: tuple[tuple[int, ...], ...]
    computed_tokens: int
    prefix_hit_tokens: int
    remote_engine_id: str
    release: Release
    recomputed_tokens: int = 0  # of [.., computed_tokens), the last ones D recomputes itself (not moved)


@dataclass
class KvgeomMetadataFields:
    """What one scheduler step hands the workers (the connector's metadata class carries these)."""

    pulls: list[Pull] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    sends: dict[str, float] = field(default_factory=dict)  # P request -> its lease in seconds


# ---- kv_transfer_params: a client's (through a proxy) input, checked before anything uses it -----
# vLLM takes kv_transfer_params from the request body, so any client of the API sets them: every
# field is checked for its type and bounds here, and a request whose fields do not pass is served
# without remote KV (D computes the prompt itself) and logged, never raised into vLLM's scheduler.


def _field_error(key: str, what: str, value: Any, expected: str) -> ExecutorError:
    return ExecutorError(f"kv_transfer_params.{key}", f"{what}, got {value_text(value, 60)}", actual=value_text(value, 60),
                         expected=expected, fix="pass the kv_transfer_params P's response returned, unchanged")


def _text(params: dict[str, Any], key: str, limit: int) -> str:
    value = params.get(key)
    if type(value) is not str or not value or len(value) > limit:
        raise _field_error(key, "must be a non-empty string", value, f"a string of 1 to {limit} characters")
    return value


def _count(params: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = params.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise _field_error(key, "must be an integer in range", value, f"an int in [{lo}, {hi}]")
    return value


def _release_of(params: dict[str, Any]) -> Release:
    """P's side channel and request from ``params`` (checked: ``ExecutorError`` names a bad field)."""
    tp = 1 if params.get("tp_size") is None else _count(params, "tp_size", 1, _MAX_TP)
    port = _count(params, "remote_port", 1, 65536 - tp)  # (P's ranks listen on port + rank)
    request_id = _text(params, "remote_request_id", MAX_ID)
    if "|" in request_id:
        raise _field_error("remote_request_id", "must not contain '|'", request_id, "P's request id")
    return Release(request_id, _text(params, "remote_host", _MAX_HOST), port, tp)


def _lists(value: Any, key: str = "remote_block_ids") -> tuple[tuple[int, ...], ...]:
    """``remote_block_ids`` as per-group tuples (vLLM's proxies pass one list per group, or one flat
    list): ints in [0, 2**31), at most ``MAX_REMOTE_IDS`` in all and ``MAX_REMOTE_GROUPS`` lists
    (checked on the lengths first); ``ExecutorError`` names what is wrong."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REMOTE_IDS:
        raise _field_error(key, "must be a list of block ids or a list of such lists", value,
                           f"at most {MAX_REMOTE_IDS} ids in at most {MAX_REMOTE_GROUPS} lists")
    groups = [value] if all(type(v) is int for v in value) else value
    if len(groups) > MAX_REMOTE_GROUPS or not all(isinstance(g, (list, tuple)) for g in groups) \
            or sum(len(g) for g in groups) > MAX_REMOTE_IDS:
        raise _field_error(key, "must be a list of block ids or a list of such lists", value,
                           f"at most {MAX_REMOTE_IDS} ids in at most {MAX_REMOTE_GROUPS} lists")
    out = tuple(tuple(g) for g in groups)
    for gi, g in enumerate(out):
        if not all(type(b) is int and 0 <= b <= _MAX_BLOCK_ID for b in g):
            raise _field_error(f"{key}[{gi}]", "must hold block ids only", list(g), f"ints in [0, {_MAX_BLOCK_ID}]")
    return out


def _own_lists(value: Any) -> tuple[tuple[int, ...], ...]:
    """P's own block ids from vLLM (one list, or one per group) as per-group tuples."""
    if value and all(isinstance(v, int) for v in value):
        return (tuple(int(v) for v in value),)
    return tuple(tuple(int(v) for v in group) for group in value)


@dataclass(frozen=True)
class _Remote:
    """A D request's checked ``kv_transfer_params``."""

    blocks: tuple[tuple[int, ...], ...]
    engine_id: str
    release: Release
    num_tokens: int | None


def _remote_of(params: dict[str, Any]) -> _Remote:
    tokens = None if not params.get("remote_num_tokens") else _count(params, "remote_num_tokens", 0, _MAX_TOKENS)
    return _Remote(_lists(params.get("remote_block_ids")), _text(params, "remote_engine_id", MAX_ID),
                   _release_of(params), tokens)


class KvgeomScheduler:
    """Scheduler-side state of one vLLM engine (both roles: ``kv_both``)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any = None) -> None:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.engine_id = engine_id
        self.host = os.environ.get("KVGEOM_SIDE_CHANNEL_HOST", "127.0.0.1")
        self.port = int(extra.get("side_channel_port", os.environ.get("KVGEOM_SIDE_CHANNEL_PORT", DEFAULT_PORT)))
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.lease_s = float(extra.get("kv_lease_duration", DEFAULT_LEASE_S))
        # a mamba hybrid: P stops one token short, D loads at most N - 1 tokens (see the module)
        self.mamba = bool(kv_cache_config is not None and getattr(kv_cache_config, "has_mamba_layers", False))
        self._local_hit: dict[str, int] = {}
        self._step = KvgeomMetadataFields()

    def on_new_request(self, request: Any) -> None:
        """P, mamba hybrids: prefill all but the last prompt token of a ``do_remote_decode`` request."""
        params = request.kv_transfer_params
        if (not self.mamba or not params or not params.get("do_remote_decode") or params.get("_kvgeom_short")
                or request.prompt_token_ids is None or request.num_prompt_tokens < 2):
            return
        skip = getattr(request, "get_skip_reading_prefix_cache", None)
        if skip is not None and skip():  # (D would not load this request: it recomputes the whole prompt)
            return
        # The request's token lists are vLLM's own (its NixlConnector edits the same fields).
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvgeom_short"] = True  # once, even if the request is scheduled again

    def _refused(self, request: Any, params: dict[str, Any], e: ExecutorError) -> None:
        """A D request whose params do not pass: served without remote KV; P released if it can be."""
        params["do_remote_prefill"] = False
        self._local_hit.pop(request.request_id, None)
        _log.warning("kvgeom connector: request %s computes its prompt itself, its kv_transfer_params are "
                     "refused: %s", request.request_id, e)
        try:
            self._step.releases.append(_release_of(params))
        except ExecutorError:
            pass  # (no side channel to tell: P frees on its lease)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill") \
                or not all(k in params for k in REQUIRED):
            return 0, False
        try:
            checked = _remote_of(params)
        except ExecutorError as e:
            self._refused(request, params, e)
            return 0, False
        remote = checked.num_tokens or request.num_prompt_tokens
        last = request.num_prompt_tokens - 1 if self.mamba else request.num_prompt_tokens
        count = min(remote, last) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        if not all(k in params for k in REQUIRED):
            params["do_remote_prefill"] = False  # one transfer per request
            return
        try:
            checked = _remote_of(params)
        except ExecutorError as e:
            self._refused(request, params, e)
            return
        params["do_remote_prefill"] = False  # one transfer per request
        release = checked.release
        hit = self._local_hit.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            self._step.releases.append(release)  # a full local hit: nothing to pull, P may free now
            return
        local = tuple(tuple(ids) for ids in blocks.get_unhashed_block_ids_all_groups())
        computed = hit + num_external_tokens
        # A load that reaches the request's last token is one token short in vLLM: once it lands the
        # scheduler steps back and recomputes that token to sample (Scheduler._update_from_kv_xfer_
        # finished), so that token's window must be on D, not the next one's (design §15.2).
        recomputed = 1 if computed >= int(request.num_tokens) else 0
        self._step.pulls.append(Pull(request.request_id, local, checked.blocks, computed, hit, checked.engine_id,
                                     release, recomputed))

    def build_connector_meta(self) -> KvgeomMetadataFields:
        step, self._step = self._step, KvgeomMetadataFields()
        return step

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: one list (a one-group model) or one list per group (``request_finished_all_groups``)."""
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        self._local_hit.pop(request.request_id, None)
        if params.get("do_remote_prefill"):  # D: finished before its blocks were allocated (aborted)
            params["do_remote_prefill"] = False
            if all(k in params for k in REQUIRED):
                try:
                    self._step.releases.append(_release_of(params))
                except ExecutorError as e:
                    _log.warning("kvgeom connector: request %s aborted, P not released (its lease frees it): %s",
                                 request.request_id, e)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted on P: free now, nothing to send
        groups = _own_lists(block_ids) if block_ids else ()
        if not any(groups):
            return False, None
        from .executor import local_executor

        worker = local_executor(self.engine_id) if self.tp == 1 else None
        if worker is not None:  # the worker is in this process: it holds from now, not from the next step
            worker.send(request.request_id, self.lease_s)
        else:
            self._step.sends[request.request_id] = self.lease_s
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(g) for g in groups], "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id, "remote_host": self.host, "remote_port": self.port,
            "tp_size": self.tp, "remote_num_tokens": int(request.num_computed_tokens),
        }

    def loaded_group_ids(self, kv_cache_config: Any) -> tuple[int, ...]:
        """Every transferred KV-cache group: a pull fills each of them (vLLM must not zero them)."""
        ids = getattr(kv_cache_config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else tuple(range(len(kv_cache_config.kv_cache_groups)))
