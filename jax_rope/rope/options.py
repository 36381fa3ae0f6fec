"""RoPE options and validation: every rule of spec/rope.md, in one place.

The public functions call these checks once per call, so a bad call fails at
trace time with a message naming the argument, the expectation and what was
given; the C++ handlers check again.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_rope.core.codes import RotaryMode
from jax_rope.core.layouts import ROPE_LAYOUTS, AxisRoles
from jax_rope.core.validation import check_dtypes, shape_and_dtype

#: Rotary mode names and their codes.
ROTARY_MODES = {mode.name.lower(): int(mode) for mode in RotaryMode}


@dataclasses.dataclass(frozen=True)
class RopeOptions:
    """Static configuration of one RoPE call (hashable: a primitive parameter)."""

    layout: str  # canonical name: BSH is stored as BSND
    rotary_mode: str
    backend: str  # "auto" | "ffi" | "fallback", resolved when the call is traced
    # Forward on a kernel (CPU or NPU): outputs aliased to query/key (XLA then hands
    # the kernel the input buffers when they are donated or dead, else copies them).
    in_place: bool = False

    @property
    def roles(self) -> AxisRoles:
        return ROPE_LAYOUTS[self.layout]

    @property
    def mode_code(self) -> int:
        return ROTARY_MODES[self.rotary_mode]


def make_options(layout, rotary_mode, backend, in_place=False) -> RopeOptions:
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {in_place!r}")
    if not isinstance(layout, str) or layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(ROPE_LAYOUTS)}, got {layout!r}")
    if not isinstance(rotary_mode, str) or rotary_mode not in ROTARY_MODES:
        raise ValueError(
            f"rotary_mode must be one of {sorted(ROTARY_MODES)}, got {rotary_mode!r}")
    return RopeOptions(ROPE_LAYOUTS[layout].name, rotary_mode, backend, in_place)


def check_rope_shapes(options: RopeOptions, query, key, cos, sin,
                      names=("query", "key", "cos", "sin")) -> None:
    """Validates shapes and dtypes of a forward (or backward) call."""
    qn, kn, cn, sn = names
    shapes = {n: shape_and_dtype(n, x)[0] for n, x in zip(names, (query, key, cos, sin))}
    check_dtypes(list(zip(names, (query, key, cos, sin))))
    roles = options.roles
    expected = roles.describe_shape()
    for name, shape in shapes.items():
        if len(shape) != roles.rank:
            raise ValueError(
                f"{name} must have rank {roles.rank} {expected} for layout "
                f"{options.layout}{' (or BSH, its legacy name)' if options.layout == 'BSND' else ''}"
                f", got shape {shape}")
        if 0 in shape:
            raise ValueError(f"{name} must not have an axis of size 0, got shape {shape}")
    q, k, c, s = (shapes[n] for n in names)
    if c != s:
        raise ValueError(f"{sn} must have the shape of {cn} {c}, got {s}")
    for axis in range(roles.rank):
        if axis != roles.head and k[axis] != q[axis]:
            raise ValueError(
                f"{kn} must match {qn} on every axis but the head axis ({axis} of "
                f"{expected}): {qn} shape {q}, {kn} shape {k}")
    if c[roles.head] != 1:
        raise ValueError(f"{cn} must have head axis (axis {roles.head}) of size 1, got shape {c}")
    if c[roles.seq] != q[roles.seq]:
        raise ValueError(
            f"{cn} must have sequence length {q[roles.seq]} on axis {roles.seq}, got shape {c}")
    if roles.batch is not None and c[roles.batch] not in (1, q[roles.batch]):
        raise ValueError(
            f"{cn} batch (axis {roles.batch}) must be 1 or {q[roles.batch]}, got shape {c}")
    head_dim, rotary_dim = q[-1], c[-1]
    multiple = 4 if options.rotary_mode == "quarter" else 2
    if head_dim % multiple:
        raise ValueError(
            f"{qn} head dim (last axis) must be divisible by {multiple} in "
            f"{options.rotary_mode} mode, got {head_dim}")
    if rotary_dim % multiple:
        raise ValueError(
            f"{cn} rotary dim (last axis) must be divisible by {multiple} in "
            f"{options.rotary_mode} mode, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(
            f"{cn} rotary dim (last axis) must be <= the head dim {head_dim}, got {rotary_dim}")


def check_grad_inputs(options: RopeOptions, grad_query, grad_key, cos, sin, query, key):
    """Validates apply_rotary_pos_emb_grad's arguments."""
    if options.rotary_mode != "half":
        raise ValueError(
            f"rotary_mode must be 'half' for the gradient (the NPU rule), "
            f"got {options.rotary_mode!r}")
    check_rope_shapes(options, grad_query, grad_key, cos, sin,
                      names=("grad_query_out", "grad_key_out", "cos", "sin"))
    if (query is None) != (key is None):
        raise ValueError(
            "query and key must be given together or not at all, got "
            f"query={'None' if query is None else 'an array'}, "
            f"key={'None' if key is None else 'an array'}")
    if query is not None:
        for name, x, like, like_name in (("query", query, grad_query, "grad_query_out"),
                                         ("key", key, grad_key, "grad_key_out")):
            shape, dtype = shape_and_dtype(name, x)
            if shape != tuple(like.shape):
                raise ValueError(
                    f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {shape}")
            if dtype != jnp.dtype(like.dtype):
                raise TypeError(
                    f"{name} must have the dtype of {like_name} "
                    f"({jnp.dtype(like.dtype).name}), got {dtype.name}")


def ffi_attributes(options: RopeOptions) -> dict:
    """The attributes the C++ handlers decode once per call."""
    return {"layout": np.int32(options.roles.code), "rotary_mode": np.int32(options.mode_code)}
