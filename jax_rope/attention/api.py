"""Public masked attention (spec/attention.md): sparse_mask, attention_scores and
flash_attention_score with gradients for query, key and value."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_rope.attention import ops
from jax_rope.attention.masks import sparse_mask
from jax_rope.attention.options import MAX_TOKENS


def attention_scores(query, key, *, input_layout="BSND", head_num=None, scale=None,
                     sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                     atten_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """Masked, scaled attention scores in float32.

    Returns (B, N1, Sq, Skv), or (N1, Tq, Tkv) for TND, where masked positions
    (and, for TND, positions of different sequences) hold -3.4028235e38.
    Arguments and errors as in `flash_attention_score`.
    """
    call = ops.prepare(
        query, key, input_layout=input_layout, head_num=head_num, scale=scale,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen)
    return ops.scores(call)


def flash_attention_score(query, key, value, *, input_layout="BSND", head_num=None, scale=None,
                          sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                          atten_mask=None, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None):
    """Fused masked attention: softmax(scale * q k^T, masked by sparse_mode) @ v.

    Args:
      query, key, value: in `input_layout` BSND (B, S, N, D), BNSD, BSH/SBH
        (hidden N*D, `head_num`=N1 required) or TND (packed tokens); float32,
        float16 or bfloat16; N1 % N2 == 0 (GQA); value's head dim Dv <= D.
      scale: None means 1/sqrt(D).
      sparse_mode: 0-8 as in spec/attention.md, with pre_tokens/next_tokens,
        atten_mask (bool/uint8, True = masked), prefix (modes 5/6) and the
        cumulative actual_seq_qlen/actual_seq_kvlen of TND (may be traced).

    Returns:
      (attention_out, softmax_max, softmax_sum): out in query's layout and dtype
      with value's head dim; the float32 statistics (B, N1, Sq), or (Tq, N1) for
      TND. Rows with no visible key give 0, -3.4028235e38 and 3.4028235e38.
      Differentiable with respect to query, key and value (through attention_out).

    Raises:
      ValueError/TypeError at trace time for input that breaks attention.md's rules; for
      traced actual_seq_qlen/actual_seq_kvlen/prefix, the same ValueError (inside the
      runtime error) when the computation runs, unless `jax_rope.runtime_checks(False)`.
      Masked positions never influence the result, NaN or Inf included.
    """
    call = ops.prepare(
        query, key, value, input_layout=input_layout, head_num=head_num, scale=scale,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen)
    out, softmax_max, softmax_sum = _flash(call.options, call.query, call.key, call.value,
                                           call.table, call.mask)
    return call.merge_heads(out), softmax_max, softmax_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(options, query, key, value, table, mask):
    return ops.forward(options, query, key, value, table, mask)


def _flash_fwd(options, query, key, value, table, mask):
    args = (query.value, key.value, value.value, table.value)
    mask = jax.tree.map(lambda m: m.value, mask)
    outs = ops.forward(options, *args, mask)
    return outs, (args, outs, mask)


def _flash_bwd(options, residuals, cotangents):
    (query, key, value, table), (out, softmax_max, softmax_sum), mask = residuals
    dout, dmax, dsum = cotangents
    if not (isinstance(dmax, SymbolicZero) and isinstance(dsum, SymbolicZero)):
        raise ValueError("flash_attention_score is differentiable through attention_out only; "
                         "softmax_max and softmax_sum are statistics without a gradient")
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    grads = ops.backward(options, query, key, value, out, dout, softmax_max, softmax_sum, table,
                         mask)
    return grads + (None, None)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)
