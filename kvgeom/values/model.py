"""Model-wide facts both engines share: groups, layer counts, KV heads, head bytes, state sections.

These are the *global coordinates* of docs/design.md §3.1, independent of any engine::

    attention group  : (layer, token, kv plane, KV head, byte of a head vector)
    MLA group        : (layer, token, byte of the latent)          one plane, one head, replicated
    state group      : (layer, section, channel, row, byte)        one state per request per layer

Worked number: a Llama-3-70B-like model has one full-attention group of 80 layers with 8 KV heads
of 128 bf16 values, so ``head_bytes = 128 * 2 = 256`` and one token of one layer is
``2 planes * 8 heads * 256 B = 4096 B`` across the whole TP group.

The model also fixes the global layer order that pipeline stages partition (docs/design.md §11.1):
``global_layers[g][i]`` is the global index of layer ``i`` of group ``g``. By default the groups
interleave, layer 0 of every group (in group order) before layer 1 of any::

    groups mla (2 layers), kda (2 layers)       default order: mla0 kda0 mla1 kda1 = 0 1 2 3
    global_layers = ((0, 1), (2, 3))            mla0 mla1 kda0 kda1 (given explicitly)
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Union

import attrs

from ..errors import GeometryError
from .fields import as_tuple, check_int, pos_int

__all__ = [
    "GroupKind",
    "AttentionSpec",
    "StateSection",
    "StateSpec",
    "GroupSpec",
    "ModelSpec",
    "default_layer_order",
]


class GroupKind(str, enum.Enum):
    """What a KV-cache group stores."""

    FULL = "full"  # full attention: every token, heads sharded across TP
    SLIDING = "sliding"  # sliding window: lists only its tail window
    MLA = "mla"  # one latent per token, replicated across TP
    STATE = "state"  # mamba / linear attention recurrent state

    def __str__(self) -> str:
        return self.value


def _kind(value: Any) -> GroupKind:
    try:
        return GroupKind(value)
    except ValueError:
        raise GeometryError(
            "AttentionSpec.kind",
            f"unknown group kind {value!r}",
            actual=value,
            expected=[k.value for k in GroupKind if k is not GroupKind.STATE],
            fix="use 'full', 'sliding' or 'mla' (state groups use StateSpec)",
        ) from None


@attrs.frozen
class AttentionSpec:
    """An attention group: ``num_layers`` layers of per-token KV.

    ``head_bytes`` is the size of one head vector of one plane (K or V); for MLA it is the size
    of the whole latent (e.g. (512 + 64) * 2 B = 1152 B for DeepSeek-V3 in bf16).
    """

    name: str
    kind: GroupKind = attrs.field(converter=_kind)
    num_layers: int = attrs.field(validator=pos_int)
    num_kv_heads: int = attrs.field(validator=pos_int)
    head_bytes: int = attrs.field(validator=pos_int)
    window_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        path = f"AttentionSpec({self.name!r})"
        if self.kind is GroupKind.STATE:
            raise GeometryError(
                f"{path}.kind", "state groups are described by StateSpec", actual="state",
                fix="use StateSpec(name, num_layers, sections)",
            )
        if self.kind is GroupKind.MLA and self.num_kv_heads != 1:
            raise GeometryError(
                f"{path}.num_kv_heads", f"MLA has one latent per token, got {self.num_kv_heads} heads",
                actual=self.num_kv_heads, expected=1, fix="set num_kv_heads=1 for MLA",
            )
        if self.kind is GroupKind.SLIDING:
            if self.window_tokens is None:
                raise GeometryError(
                    f"{path}.window_tokens", "a sliding-window group needs its window",
                    expected="int >= 1", fix="pass window_tokens=<window size in tokens>",
                )
            check_int(f"{path}.window_tokens", self.window_tokens, minimum=1)
        elif self.window_tokens is not None:
            raise GeometryError(
                f"{path}.window_tokens", f"only sliding groups have a window, this one is {self.kind}",
                actual=self.window_tokens, expected=None, fix="drop window_tokens or use kind='sliding'",
            )

    @property
    def planes(self) -> int:
        """K and V (2), or a single latent plane for MLA (1)."""
        return 1 if self.kind is GroupKind.MLA else 2

    @property
    def replicated(self) -> bool:
        """MLA latents are held whole by every rank."""
        return self.kind is GroupKind.MLA

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer over all heads and planes (whole model, not per rank)."""
        return self.planes * self.num_kv_heads * self.head_bytes


@attrs.frozen
class StateSection:
    """One named section of a recurrent state, e.g. conv ``x`` or the temporal ``ssm`` state.

    The section is a ``[channels, rows, unit_bytes]`` array over the whole model: ``channels`` is
    the global count along the sharded axis (channels, groups or heads), ``rows`` the rows per
    channel (conv: ``kernel - 1``; ssm: 1) and ``unit_bytes`` the bytes of one (channel, row).
    ``replicated`` sections are held whole by every rank.

    Worked number: Mamba2 ``ssm`` with 128 heads of 64 x 128 fp32 values:
    ``StateSection("ssm", channels=128, unit_bytes=64 * 128 * 4)``.
    """

    name: str
    channels: int = attrs.field(validator=pos_int)
    unit_bytes: int = attrs.field(validator=pos_int)
    rows: int = attrs.field(default=1, validator=pos_int)
    replicated: bool = attrs.field(default=False)

    @replicated.validator
    def _replicated_is_bool(self, attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise GeometryError("StateSection.replicated", f"must be a bool, got {type(value).__name__} {value!r}",
                                actual=value, expected="True or False", fix="pass replicated=True or False")

    @property
    def channel_bytes(self) -> int:
        return self.rows * self.unit_bytes


def _sections(value: Any) -> tuple[StateSection, ...]:
    return as_tuple(value, "StateSpec.sections")


@attrs.frozen
class StateSpec:
    """A mamba / linear-attention group: one state per request per layer, made of sections."""

    name: str
    num_layers: int = attrs.field(validator=pos_int)
    sections: tuple[StateSection, ...] = attrs.field(converter=_sections)

    def __attrs_post_init__(self) -> None:
        path = f"StateSpec({self.name!r}).sections"
        if not self.sections:
            raise GeometryError(path, "a state group needs at least one section", actual=(),
                                fix="list its sections, e.g. conv x, B, C and ssm")
        for i, s in enumerate(self.sections):
            if not isinstance(s, StateSection):
                raise GeometryError(f"{path}[{i}]", f"expected StateSection, got {type(s).__name__}",
                                    actual=s, fix="build sections with StateSection(...)")
        names = [s.name for s in self.sections]
        if len(set(names)) != len(names):
            raise GeometryError(path, f"section names repeat: {names}", actual=names,
                                fix="give every section a distinct name")

    @property
    def kind(self) -> GroupKind:
        return GroupKind.STATE


GroupSpec = Union[AttentionSpec, StateSpec]


def _groups(value: Any) -> tuple[GroupSpec, ...]:
    return as_tuple(value, "ModelSpec.groups")


def _global_layers(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    return tuple(as_tuple(v, "ModelSpec.global_layers[...]") for v in as_tuple(value, "ModelSpec.global_layers"))


@functools.lru_cache(maxsize=256)
def default_layer_order(counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Groups' layers interleaved: layer i of every group, in group order, before layer i + 1.

    >>> default_layer_order((2, 3))
    ((0, 2), (1, 3, 4))
    """
    pairs = sorted((i, g) for g, n in enumerate(counts) for i in range(n))
    out: list[list[int]] = [[] for _ in counts]
    for k, (_, g) in enumerate(pairs):
        out[g].append(k)
    return tuple(tuple(x) for x in out)


@attrs.frozen
class ModelSpec:
    """The model facts both engines must agree on: its groups, in order, the cache dtype, and the
    global layer order pipeline stages partition (``global_layers``; None: the groups interleave,
    :func:`default_layer_order`)."""

    name: str
    groups: tuple[GroupSpec, ...] = attrs.field(converter=_groups)
    dtype: str = "bfloat16"
    global_layers: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_global_layers)

    def __attrs_post_init__(self) -> None:
        if not self.groups:
            raise GeometryError("ModelSpec.groups", "a model needs at least one group", actual=(),
                                fix="add an AttentionSpec or StateSpec")
        for i, g in enumerate(self.groups):
            if not isinstance(g, (AttentionSpec, StateSpec)):
                raise GeometryError(f"ModelSpec.groups[{i}]", f"expected AttentionSpec or StateSpec, got {type(g).__name__}",
                                    actual=g, fix="build groups with AttentionSpec(...) or StateSpec(...)")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise GeometryError("ModelSpec.groups", f"group names repeat: {names}", actual=names,
                                fix="give every group a distinct name")
        if self.global_layers is not None:
            self._check_global_layers(self.global_layers)

    def _check_global_layers(self, order: tuple[tuple[int, ...], ...]) -> None:
        path = "ModelSpec.global_layers"
        if len(order) != len(self.groups):
            raise GeometryError(path, f"{len(order)} layer lists for {len(self.groups)} groups", actual=len(order),
                                expected=len(self.groups), fix="give the global index of every layer of every group")
        total = self.num_global_layers
        seen: set[int] = set()
        for gi, (g, layers) in enumerate(zip(self.groups, order)):
            if len(layers) != g.num_layers:
                raise GeometryError(f"{path}[{gi}]", f"{len(layers)} indices for the {g.num_layers} layers of "
                                    f"group {g.name!r}", actual=len(layers), expected=g.num_layers,
                                    fix="one global index per layer of the group")
            for li, x in enumerate(layers):
                check_int(f"{path}[{gi}][{li}]", x, minimum=0)
                if x >= total or x in seen:
                    raise GeometryError(f"{path}[{gi}][{li}]", f"global layer {x} is outside [0, {total}) or named "
                                        "twice", actual=x, expected=f"every index of [0, {total}) once",
                                        fix="number the model's layers 0..L-1, each once")
                seen.add(x)
            if any(b <= a for a, b in zip(layers, layers[1:])):
                raise GeometryError(f"{path}[{gi}]", f"group {g.name!r}'s global indices {list(layers)} do not "
                                    "increase", actual=layers, expected="increasing indices",
                                    fix="a group's layer i comes before its layer i + 1 in the model")

    @property
    def num_global_layers(self) -> int:
        """Layers of the whole model (every group's, each one global layer)."""
        return sum(g.num_layers for g in self.groups)

    def layer_order(self) -> tuple[tuple[int, ...], ...]:
        """``global_layers``, or the default interleaved order when it is None."""
        if self.global_layers is not None:
            return self.global_layers
        return default_layer_order(tuple(g.num_layers for g in self.groups))

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise GeometryError("group", f"no group named {name!r}", actual=name,
                            expected=[g.name for g in self.groups])

