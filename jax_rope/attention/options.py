"""Attention options and validation: every rule of spec/attention.md, in one place.

`attention_call(...)` checks a public call at trace time and returns the static
options (a hashable primitive parameter) plus the canonical operands: query,
key and value with a head axis (BSH/SBH split), and the lengths/prefix/mask as
given. Rules on the values of lengths and prefix live in value_checks.py: they
run here on concrete values and, for traced ones, when the computation runs.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jax_rope.attention import sparse_modes
from jax_rope.attention.value_checks import (INT32_MAX, INT32_MIN, ValueChecks, check_int32_range,
                                              concrete)
from jax_rope.core.layouts import ATTENTION_LAYOUTS, AttentionLayout
from jax_rope.core.validation import check_dtypes, check_int

MAX_TOKENS = 2147483647  # pre_tokens/next_tokens default: no limit
# The statistics of a row that sees no key (spec/attention.md): its max and sum.
MASK_VALUE = np.float32(-3.4028235e38)
DEAD_ROW_SUM = np.float32(3.4028235e38)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Static configuration of one attention call (hashable: a primitive parameter)."""

    layout: str
    scale: float
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    has_mask: bool  # an element mask operand follows the sequence table
    backend: str
    # spec/attention_bias_dropout.md (bias.py, dropout.py)
    pse_type: int = 1
    bias: str | None = None  # kernel kind: tensor, compressed, packed, alibi, alibi_sqrt
    bias_form: str | None = None  # the caller's form: full, row, compressed, packed_*, slopes
    static_offsets: tuple | None = (0, 0)  # (q_start_idx, kv_start_idx) when concrete
    static_lengths: tuple | None = None  # TND ((Sq_b...), (Skv_b...)) when concrete
    # TND lengths with Sq_b > Skv_b in some sequence, and with Sq_b > 0 == Skv_b in one:
    # None where the lengths are traced (known when the call runs).
    sq_above_skv: bool | None = False
    keyless_sequence: bool | None = False
    dropout: str | None = None  # None, "key" (dropout_key) or "mask" (dropout_mask)
    keep_prob: float = 1.0
    # TND: copies that vmap folded into the token axis, each T / copies tokens long with
    # its sequences' starts shifted by its offset (the batching rule's).
    copies: int = 1

    @property
    def layout_info(self) -> AttentionLayout:
        return ATTENTION_LAYOUTS[self.layout]

    @property
    def varlen(self) -> bool:
        return self.layout == "TND"

    @property
    def extra_names(self) -> tuple:
        """The optional operands after the sequence table, in order."""
        names = ("mask",) if self.has_mask else ()
        if self.bias is not None:
            names += ("bias", "offsets") if self.bias.startswith("alibi") else ("bias",)
        if self.dropout is not None:
            names += ("drop_keys", "drop_rows")
            names += ("drop_mask",) if self.dropout == "mask" else ()
        return names

    @property
    def score_extra_names(self) -> tuple:
        """Those of the scores primitive (no dropout)."""
        return tuple(n for n in self.extra_names if not n.startswith("drop_"))


@dataclasses.dataclass(frozen=True)
class AttentionSizes:
    batch: int  # sequences (TND: len(actual_seq_qlen))
    q_len: int  # Sq (TND: Tq)
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int


def _check_integers(name, x) -> None:
    """An integer array (or sequence) whose concrete values fit in int32."""
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {dtype.name} "
                        f"(values are not converted)")
    values = concrete(x)
    if values is not None:
        check_int32_range(name, values)


def split_heads(x, info: AttentionLayout, heads: int):
    """BSH/SBH (.., N*D) -> (.., N, D); other layouts unchanged."""
    if not info.packed_heads:
        return x
    return x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))


def merge_heads(x, info: AttentionLayout):
    return x.reshape(x.shape[:-2] + (-1,)) if info.packed_heads else x


def _head_counts(info, query, key, value, head_num):
    """(N1, N2) and the head-split shapes, checking head_num."""
    if info.packed_heads:
        if head_num is None:
            raise ValueError(f"head_num is required for input_layout {info.name}, got None")
        head_num = check_int("head_num", head_num)
        hq = query.shape[-1]
        if head_num <= 0 or hq % head_num:
            raise ValueError(
                f"head_num must be a positive divisor of query's hidden size {hq}, got {head_num}")
        d = hq // head_num
        if key.shape[-1] % d:
            raise ValueError(
                f"key hidden size must be a multiple of the head dim {d}, got {key.shape[-1]}")
        n2 = key.shape[-1] // d
        if n2 == 0 or value.shape[-1] % n2:
            raise ValueError(
                f"value hidden size must be a multiple of the key head count {n2}, "
                f"got {value.shape[-1]}")
        return head_num, n2
    roles = info.roles
    n1, n2 = query.shape[roles.head], key.shape[roles.head]
    if head_num is not None and check_int("head_num", head_num) != n1:
        raise ValueError(f"head_num must equal query's head count {n1}, got {head_num}")
    if value.shape[roles.head] != n2:
        raise ValueError(
            f"value must have key's head count {n2} on axis {roles.head}, got shape {value.shape}")
    return n1, n2


def _check_ranks(info, query, key, value) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != info.rank:
            raise ValueError(f"{name} must have rank {info.rank} for input_layout {info.name}, "
                             f"got shape {tuple(x.shape)}")
        if info.name != "TND" and 0 in x.shape:
            raise ValueError(f"{name} must not have an axis of size 0, got shape {tuple(x.shape)}")


def _check_shapes(info, query, key, value, n1, n2) -> AttentionSizes:
    q, k, v = (split_heads(x, info, n) for x, n in ((query, n1), (key, n2), (value, n2)))
    roles = info.roles
    if 0 in (n1, n2, q.shape[-1], v.shape[-1]):
        raise ValueError(f"query/key/value must have heads and head dims, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if n1 % n2:
        raise ValueError(f"query heads N1={n1} must be a multiple of key/value heads N2={n2}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key head dim must equal query head dim {q.shape[-1]}, got {k.shape[-1]}")
    if v.shape[-1] > q.shape[-1]:
        raise ValueError(f"value head dim Dv must be <= D={q.shape[-1]}, got {v.shape[-1]}")
    if v.shape[roles.seq] != k.shape[roles.seq]:
        raise ValueError(f"value must have key's sequence length {k.shape[roles.seq]}, "
                         f"got shape {tuple(value.shape)}")
    batch = 0
    if roles.batch is not None:
        batch = q.shape[roles.batch]
        for name, x in (("key", k), ("value", v)):
            if x.shape[roles.batch] != batch:
                raise ValueError(f"{name} must have query's batch {batch}, "
                                 f"got shape {tuple(x.shape)}")
    return AttentionSizes(batch, q.shape[roles.seq], k.shape[roles.seq], n1, n2,
                          q.shape[-1], v.shape[-1])


def _check_length_arrays(sizes, actual_seq_qlen, actual_seq_kvlen, varlen) -> AttentionSizes:
    """Presence, shapes and dtypes of the TND lengths; sizes with the sequence count."""
    if not varlen:
        if actual_seq_qlen is not None or actual_seq_kvlen is not None:
            raise ValueError("actual_seq_qlen/actual_seq_kvlen are for input_layout TND only, "
                             "got lengths with a padded layout")
        return sizes
    for name, x in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
        if x is None:
            raise ValueError(f"{name} is required for input_layout TND, got None")
        if len(np.shape(x)) != 1 or np.shape(x)[0] == 0:
            raise ValueError(f"{name} must be a non-empty 1-D sequence of cumulative lengths, "
                             f"got shape {np.shape(x)}")
        _check_integers(name, x)
    if np.shape(actual_seq_qlen) != np.shape(actual_seq_kvlen):
        raise ValueError("actual_seq_kvlen must have the length of actual_seq_qlen "
                         f"{np.shape(actual_seq_qlen)[0]}, got {np.shape(actual_seq_kvlen)[0]}")
    return dataclasses.replace(sizes, batch=np.shape(actual_seq_qlen)[0])


def _check_prefix_array(prefix, mode, sizes):
    if not sparse_modes.rule(mode).needs_prefix:
        return None
    if prefix is None:
        raise ValueError(f"prefix is required for sparse_mode {mode}, got None")
    if len(np.shape(prefix)) != 1 or np.shape(prefix)[0] != sizes.batch:
        raise ValueError(f"prefix must be a sequence of length B={sizes.batch}, "
                         f"got shape {np.shape(prefix)}")
    _check_integers("prefix", prefix)
    return prefix


def _check_mask(atten_mask, mode, sizes, varlen):
    """Returns the element mask to apply (uint8, 4-D) or None. (For TND, whether it
    covers every sequence depends on the lengths: value_checks.py.)"""
    rule = sparse_modes.rule(mode)
    if atten_mask is None:
        if rule.mask_required:
            raise ValueError(f"atten_mask is required for sparse_mode {mode}, got None")
        return None
    if not hasattr(atten_mask, "shape") or jnp.dtype(atten_mask.dtype) not in (
            jnp.dtype(bool), jnp.dtype(jnp.uint8)):
        raise TypeError(f"atten_mask must be a bool or uint8 array, got "
                        f"{getattr(atten_mask, 'dtype', type(atten_mask).__name__)}")
    shape = tuple(atten_mask.shape)
    if not rule.element_mask:
        if shape != rule.compressed_mask:
            raise ValueError(f"atten_mask in sparse_mode {mode} must be the compressed "
                             f"{rule.compressed_mask} mask or None, got shape {shape}")
        return None  # the geometry comes from the mode alone
    if varlen:
        ok = len(shape) == 2
        expected = "(maxSq, maxSkv)"
    else:
        sq, skv, b, n1 = sizes.q_len, sizes.kv_len, sizes.batch, sizes.q_heads
        ok = shape in ((sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, n1, sq, skv))
        expected = f"({sq}, {skv}), (1, 1, {sq}, {skv}), ({b}, 1, {sq}, {skv}) or ({b}, {n1}, {sq}, {skv})"
    if not ok:
        raise ValueError(f"atten_mask must have shape {expected}, got {shape}")
    mask = atten_mask.astype(jnp.uint8) if jnp.dtype(atten_mask.dtype) == bool else atten_mask
    return mask[None, None] if mask.ndim == 2 else mask


def _sequences_where(varlen, pairs, rule) -> bool | None:
    """Whether some TND sequence's (Sq_b, Skv_b) meets `rule`: None for traced lengths."""
    if not varlen:
        return False
    return None if pairs is None else any(rule(a, b) for a, b in pairs)


def attention_call(query, key, value, *, input_layout, head_num, scale, sparse_mode,
                   pre_tokens, next_tokens, atten_mask, prefix, actual_seq_qlen,
                   actual_seq_kvlen, backend, needs_value=True, pse=None, pse_type=1,
                   q_start_idx=0, kv_start_idx=0, keep_prob=1.0, dropout_key=None,
                   dropout_mask=None):
    """Validates a public call at trace time: returns (options, sizes, (q, k, v) with heads,
    mask, prefix, value_checks, extra_inputs) where extra_inputs holds the validated bias
    and dropout arguments (bias.py, dropout.py; see ops.prepare). The rules that depend on values of actual_seq_qlen/kvlen or
    prefix are checked here when those are concrete; `value_checks` checks traced ones when
    the computation runs (ops.prepare, core/runtime_checks.py)."""
    if not isinstance(input_layout, str) or input_layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"input_layout must be one of {sorted(ATTENTION_LAYOUTS)}, "
                         f"got {input_layout!r}")
    layout = ATTENTION_LAYOUTS[input_layout]
    mode = check_int("sparse_mode", sparse_mode)
    if mode not in sparse_modes.RULES:
        raise ValueError(f"sparse_mode must be in 0..8, got {mode}")
    layouts = sparse_modes.rule(mode).layouts
    if layouts == "TND" and layout.name != "TND":
        raise ValueError(f"sparse_mode {mode} needs input_layout TND, got {layout.name}")
    if layouts == "padded" and layout.name == "TND":
        raise ValueError(f"sparse_mode {mode} is not supported with input_layout TND")
    pre = check_int("pre_tokens", pre_tokens)
    nxt = check_int("next_tokens", next_tokens)
    for name, x in (("pre_tokens", pre), ("next_tokens", nxt)):
        if not INT32_MIN <= x <= INT32_MAX:
            raise ValueError(f"{name} must fit in int32, got {x}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    named = [("query", query), ("key", key)] + ([("value", value)] if needs_value else [])
    check_dtypes(named)
    _check_ranks(layout, query, key, value)
    n1, n2 = _head_counts(layout, query, key, value, head_num)
    sizes = _check_shapes(layout, query, key, value, n1, n2)
    for name, length in (("query", sizes.q_len), ("key", sizes.kv_len)):
        if length > sparse_modes.UNLIMITED:
            raise ValueError(f"{name} sequence length must be <= {sparse_modes.UNLIMITED} (the "
                             f"band table's limit, 2**30), got {length}")
    varlen = layout.name == "TND"
    sizes = _check_length_arrays(sizes, actual_seq_qlen, actual_seq_kvlen, varlen)
    mask = _check_mask(atten_mask, mode, sizes, varlen)
    prefix = _check_prefix_array(prefix, mode, sizes)
    checks = ValueChecks(mode, pre, nxt, varlen, sizes.batch, sizes.q_len, sizes.kv_len,
                         tuple(atten_mask.shape) if varlen and mask is not None else None,
                         mask is not None)
    checks(actual_seq_qlen, actual_seq_kvlen, prefix)  # what is concrete now
    pairs = checks.pairs(actual_seq_qlen, actual_seq_kvlen)
    from jax_rope.attention import bias, dropout  # they build on masks.py, which needs us
    info, pse, offsets = bias.check_pse(
        pse, pse_type, q_start_idx, kv_start_idx, query_dtype=query.dtype, batch=sizes.batch,
        heads=n1, q_len=sizes.q_len, kv_len=sizes.kv_len, varlen=varlen, mode=mode,
        pairs=pairs if varlen else None)
    if varlen and info.form == "compressed":
        checks = dataclasses.replace(checks, compressed_width=int(pse.shape[-1]))
        checks(actual_seq_qlen, actual_seq_kvlen, prefix)
    if not needs_value:
        keep_prob, dropout_key, dropout_mask = 1.0, None, None
    positions = n1 * sizes.q_len * (1 if varlen else sizes.batch)
    numel = None if pairs is None else n1 * sum(a * b for a, b in pairs) * (
        1 if varlen else sizes.batch)
    dropout_mode, keep_prob, words, drop_mask = dropout.check_dropout(
        keep_prob, dropout_key, dropout_mask, positions=positions, row_words=sizes.kv_len,
        numel=numel)
    static_lengths = None
    if varlen and pairs is not None and (info.kind is not None or dropout_mode is not None):
        static_lengths = tuple(tuple(p[k] for p in pairs) for k in (0, 1))
    if scale is None:
        scale = 1.0 / math.sqrt(sizes.head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    options = AttentionOptions(
        layout.name, float(scale), mode, pre, nxt, mask is not None, backend,
        pse_type=info.pse_type, bias=info.kind, bias_form=info.form,
        static_offsets=info.static_offsets, static_lengths=static_lengths,
        sq_above_skv=_sequences_where(varlen, pairs, lambda a, b: a > b),
        keyless_sequence=_sequences_where(varlen, pairs, lambda a, b: a > 0 and b == 0),
        dropout=dropout_mode, keep_prob=keep_prob)
    heads = tuple(split_heads(x, layout, n) for x, n in ((query, n1), (key, n2), (value, n2)))
    extra_inputs = {"pse": pse, "offsets": offsets, "key_words": words, "drop_mask": drop_mask,
                    "pairs": pairs}
    return options, sizes, heads, mask, prefix, checks, extra_inputs
