"""Public fused Q/K rotary position embedding (spec/rope.md) and its gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_rope.core.implementation import current_backend
from jax_rope.rope.options import check_grad_inputs, check_rope_shapes, make_options
from jax_rope.rope.primitives import rope_bwd_p, rope_fwd_p


def apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half", *,
                         in_place=False):
    """Rotates query and key by the position tables cos and sin in one fused call.

    Args:
      query: (B, S, Nq, D) for BSND/BSH, (S, B, Nq, D) for SBND, (B, Nq, S, D)
        for BNSD, (T, Nq, D) for TND; float32, float16 or bfloat16.
      key: like query, with its own head count Nk.
      cos, sin: same rank and dtype, head axis 1, batch axis 1 or B, last axis
        r <= D; only query/key[..., :r] are rotated (partial rotary).
      layout: "BSND" (default), "BSH" (same as BSND), "SBND", "BNSD" or "TND".
      rotary_mode: "half" (rotate_half), "quarter" or "interleave" (GPT-J).
      in_place: let the kernel (CPU, or the NPU operator) write query_out/key_out
        over query/key's buffers. Pays off when query and key are donated to the
        enclosing jit (`jax.jit(f, donate_argnums=...)`) or are intermediates used
        nowhere else; otherwise XLA copies them first (on the CPU slower than the
        default). The results are the same either way; the fallback ignores it.

    Returns:
      (query_out, key_out), new arrays shaped and typed like query and key.

    Raises:
      TypeError/ValueError at trace time for input that breaks rope.md's rules.
      ValueError when differentiated in a mode other than "half".
    """
    options = make_options(layout, rotary_mode, current_backend(), in_place)
    check_rope_shapes(options, query, key, cos, sin)
    return _rope(options, query, key, cos, sin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(options, query, key, cos, sin):
    return tuple(rope_fwd_p.bind(query, key, cos, sin, options=options))


def _rope_fwd(options, query, key, cos, sin):
    if options.rotary_mode != "half":
        raise ValueError(
            f"apply_rotary_pos_emb has no gradient in rotary_mode {options.rotary_mode!r}; "
            "only 'half' is differentiable (as on the NPU)")
    outs = rope_fwd_p.bind(query.value, key.value, cos.value, sin.value, options=options)
    # query/key are kept only when cos or sin need a gradient.
    needs_tables = cos.perturbed or sin.perturbed
    inputs = (query.value, key.value) if needs_tables else None
    return tuple(outs), (cos.value, sin.value, inputs)


def _instantiate(ct):
    return jnp.zeros(ct.aval.shape, ct.aval.dtype) if isinstance(ct, SymbolicZero) else ct


def _rope_bwd(options, residuals, cotangents):
    cos, sin, inputs = residuals
    grad_query, grad_key = (_instantiate(ct) for ct in cotangents)
    grads = rope_bwd_p.bind(grad_query, grad_key, cos, sin, *(inputs or ()), options=options)
    if inputs is None:
        return tuple(grads) + (None, None)
    return tuple(grads)


_rope.defvjp(_rope_fwd, _rope_bwd, symbolic_zeros=True)


def apply_rotary_pos_emb_grad(grad_query_out, grad_key_out, cos, sin, query=None, key=None,
                              layout="BSND", rotary_mode="half"):
    """The fused half-mode backward of `apply_rotary_pos_emb`.

    Args:
      grad_query_out, grad_key_out: cotangents shaped like query and key.
      cos, sin: the tables of the forward call.
      query, key: the forward inputs, both or neither; needed only for dcos/dsin.
      layout, rotary_mode: as in the forward; rotary_mode must be "half".

    Returns:
      (dquery, dkey, dcos, dsin); dcos and dsin are None without query/key.
    """
    options = make_options(layout, rotary_mode, current_backend())
    check_grad_inputs(options, grad_query_out, grad_key_out, cos, sin, query, key)
    inputs = () if query is None else (query, key)
    grads = rope_bwd_p.bind(grad_query_out, grad_key_out, cos, sin, *inputs, options=options)
    return tuple(grads) if inputs else tuple(grads) + (None, None)
