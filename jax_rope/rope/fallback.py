"""Pure jax.numpy RoPE with the semantics of spec/rope.md.

Used on every platform without a kernel and wherever a kernel does not cover a
case. Arithmetic in float32, one rounding to the input dtype at the end. XLA may
contract a product and the sum into a fused multiply-add, so float32 results
can differ from the spec's golden (and the CPU kernel) by 1 ulp; 16-bit results
are bit-identical (the final rounding absorbs it).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_rope.rope.options import RopeOptions


def _halves(x):
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


def rotate(x, rotary_mode: str):
    """rot(x) over the last axis: the partner of each element, signed."""
    if rotary_mode == "half":
        x1, x2 = _halves(x)
        return jnp.concatenate([-x2, x1], axis=-1)
    if rotary_mode == "quarter":
        return jnp.concatenate([rotate(part, "half") for part in _halves(x)], axis=-1)
    pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def _with_pass_through(rotated, x):
    r = rotated.shape[-1]
    rotated = rotated.astype(x.dtype)
    if r == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., r:]], axis=-1)


def rope_forward(query, key, cos, sin, *, options: RopeOptions):
    """(query_out, key_out) = x[:r] * cos + rot(x[:r]) * sin, x[r:] unchanged."""
    r = cos.shape[-1]
    c = cos.astype(jnp.float32)
    s = sin.astype(jnp.float32)

    def apply(x):
        xr = x[..., :r].astype(jnp.float32)
        return _with_pass_through(xr * c + rotate(xr, options.rotary_mode) * s, x)

    return apply(query), apply(key)


def _table_reduction_axes(options: RopeOptions, x_shape, cos_shape):
    roles = options.roles
    axes = [roles.head]
    if roles.batch is not None and cos_shape[roles.batch] == 1 and x_shape[roles.batch] != 1:
        axes.append(roles.batch)
    return tuple(axes)


def rope_backward(grad_query, grad_key, cos, sin, *inputs, options: RopeOptions):
    """Half-mode adjoint: (dq, dk) or (dq, dk, dcos, dsin) when query/key are given."""
    r = cos.shape[-1]
    c1, c2 = _halves(cos.astype(jnp.float32))
    s1, s2 = _halves(sin.astype(jnp.float32))

    def adjoint(g):
        g1, g2 = _halves(g[..., :r].astype(jnp.float32))
        return _with_pass_through(jnp.concatenate([c1 * g1 + s2 * g2, c2 * g2 - s1 * g1], -1), g)

    grads = (adjoint(grad_query), adjoint(grad_key))
    if not inputs:
        return grads
    dcos = jnp.zeros(cos.shape, jnp.float32)
    dsin = jnp.zeros(cos.shape, jnp.float32)
    for g, x in zip((grad_query, grad_key), inputs):
        g = g[..., :r].astype(jnp.float32)
        x = x[..., :r].astype(jnp.float32)
        axes = _table_reduction_axes(options, x.shape, cos.shape)
        dcos = dcos + jnp.sum(g * x, axis=axes, keepdims=True)
        dsin = dsin + jnp.sum(g * rotate(x, "half"), axis=axes, keepdims=True)
    return grads + (dcos.astype(cos.dtype), dsin.astype(sin.dtype))
