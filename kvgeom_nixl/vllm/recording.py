"""A NIXL agent that records what vLLM's connector prepares and posts, and lets it all run for real.

vLLM's NixlConnector worker builds its transfers from two NIXL calls (docs/design.md §10.6):

    get_xfer_descs(blocks_data)   -> a descriptor list (address, length, device) per entry
    prep_xfer_dlist(agent, dlist) -> a prepared list: local ("NIXL_INIT_AGENT") or remote (P's agent)
    make_prepped_xfer("READ", local handle, local ids, remote handle, remote ids)  -> one READ

:class:`RecordingAgent` is a subclass of NIXL's own ``nixl_agent``: every call goes to NIXL
unchanged (the bytes really move), and the agent keeps a copy of every prepared list
(:class:`PreparedList`) and of every transfer it was asked to make (:class:`PostedTransfer`),
including raw ``initialize_xfer`` calls, so that nothing the connector moves goes unrecorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nixl._api import nixl_agent

__all__ = ["PreparedList", "PostedTransfer", "RecordingAgent"]


@dataclass
class PreparedList:
    """One ``prep_xfer_dlist`` call: the handle NIXL returned, the agent it names, the descriptors."""

    handle: Any
    agent: str
    descs: np.ndarray  # (n, 2): address, length


@dataclass
class PostedTransfer:
    """One READ or WRITE the connector asked NIXL to make (``local_ids[j]`` pairs ``remote_ids[j]``)."""

    op: str
    local_handle: Any
    local_ids: np.ndarray
    remote_handle: Any
    remote_ids: np.ndarray
    raw: tuple[np.ndarray, np.ndarray] | None = None  # initialize_xfer: (local descs, remote descs)
    remote_agent: str = ""


def _descs_array(descs: Any) -> np.ndarray:
    arr = np.asarray(descs, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise ValueError(f"unexpected descriptor array of shape {arr.shape}")
    return arr[:, :2].copy()


@dataclass
class _Pending:
    descs: np.ndarray
    keep: Any = field(default=None, repr=False)  # the NIXL list object, kept alive so its id stays unique


class RecordingAgent(nixl_agent):  # type: ignore[misc]
    """``nixl_agent`` that records every prepared descriptor list and every posted transfer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prepared: list[PreparedList] = []
        self.posted: list[PostedTransfer] = []
        self._lists: dict[int, _Pending] = {}

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        out = super().get_xfer_descs(descs, mem_type)
        if id(out) not in self._lists and not type(descs).__name__.endswith("DList"):
            self._lists[id(out)] = _Pending(_descs_array(descs), out)
        return out

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None,
                        backends: list[str] | None = None) -> Any:
        handle = super().prep_xfer_dlist(agent_name, xfer_list, mem_type, backends or [])
        pending = self._lists.get(id(xfer_list))
        if pending is None:  # a raw list given directly: read it the same way
            pending = _Pending(_descs_array(xfer_list))
        self.prepared.append(PreparedList(handle, agent_name, pending.descs))
        return handle

    def make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any, remote_xfer_side: Any,
                          remote_indices: Any, notif_msg: bytes = b"", backends: list[str] | None = None,
                          skip_desc_merge: bool = False) -> Any:
        self.posted.append(PostedTransfer(operation, local_xfer_side, np.asarray(local_indices, np.int64).copy(),
                                          remote_xfer_side, np.asarray(remote_indices, np.int64).copy()))
        return super().make_prepped_xfer(operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                                         notif_msg, backends or [], skip_desc_merge)

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any, remote_agent: str,
                        notif_msg: bytes = b"", backends: list[str] | None = None) -> Any:
        local = self._lists.get(id(local_descs))
        remote = self._lists.get(id(remote_descs))
        raw = (local.descs if local else np.zeros((0, 2), np.int64), remote.descs if remote else np.zeros((0, 2), np.int64))
        n = len(raw[0])
        self.posted.append(PostedTransfer(operation, None, np.arange(n), None, np.arange(n), raw=raw,
                                          remote_agent=remote_agent))
        return super().initialize_xfer(operation, local_descs, remote_descs, remote_agent, notif_msg, backends or [])

    def list_of(self, handle: Any) -> PreparedList:
        """The prepared list behind ``handle`` (the most recent one, handles are not reused while alive)."""
        for p in reversed(self.prepared):
            if p.handle == handle:
                return p
        raise KeyError(f"no prepared descriptor list for handle {handle!r}")
