"""The nine sparse modes of FlashAttentionScore (spec/attention.md), one record
each: everything the rest of the package needs to know about a mode.

Validation (options.py), the band table (masks.py), context parallelism and
the varlen sequence-parallel split (parallel/) and the NPU coverage all read
these records instead of comparing mode numbers. Every mode is a per-sequence
band: query row i (0-based in its sequence) sees key column j when
    max(0, i + lo) <= j <= min(kv_len - 1, max(i + hi, floor))
(and the element mask, where one is given, is 0 there); `band` gives
(lo, hi, floor) per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jax_rope.core.codes import SparseMode

UNLIMITED = 1 << 30  # beyond any sequence length; keeps int32 sums exact
COMPRESSED_CAUSAL = (2048, 2048)  # the NPU's compressed mask of the causal/band modes
COMPRESSED_PREFIX = (3072, 2048)  # ... and of prefixCompress


@dataclasses.dataclass(frozen=True)
class BandInputs:
    """Per-sequence int32 vectors (length = sequences) and the static tokens."""

    q_lens: object
    kv_lens: object
    pre: int  # pre_tokens clipped to +-UNLIMITED
    next: int
    prefix: object  # int32 per sequence (modes 5/6), else None
    has_mask: bool

    @property
    def delta(self):
        return self.kv_lens - self.q_lens


def _full(inputs, value):
    return jnp.full(inputs.q_lens.shape, value, jnp.int32)


def _open(inputs):
    return _full(inputs, -UNLIMITED), _full(inputs, UNLIMITED), _full(inputs, -UNLIMITED)


def _band_default(b):
    lo, hi, floor = _open(b)
    if b.has_mask:  # with an element mask, pre/next cut a top-left band too
        return _full(b, -b.pre), _full(b, b.next), floor
    return lo, hi, floor


def _band_all(b):
    return _open(b)  # the element mask alone decides


def _band_left_up_causal(b):
    lo, _, floor = _open(b)
    return lo, _full(b, 0), floor


def _band_right_down_causal(b):
    lo, _, floor = _open(b)
    return lo, b.delta, floor


def _band_band(b):
    _, _, floor = _open(b)
    return b.delta - b.pre, b.next + b.delta, floor


def _band_prefix(b):
    lo, _, _ = _open(b)
    return lo, b.delta, jnp.asarray(b.prefix, jnp.int32).reshape(-1) - 1


def _edge(b, last: bool, elsewhere):
    """Modes 7/8: one sequence (the last / first non-empty one) carries the band."""
    lo, _, floor = _open(b)
    index = jnp.arange(b.q_lens.shape[0])
    nonempty = b.q_lens > 0
    if last:
        carrier = index == jnp.max(jnp.where(nonempty, index, -1))
    else:
        carrier = index == jnp.min(jnp.where(nonempty, index, index.shape[0]))
    return lo, jnp.where(carrier, b.next + b.delta, elsewhere), floor


def _band_right_down_causal_band(b):
    return _edge(b, True, b.delta)


def _band_band_left_up_causal(b):
    return _edge(b, False, jnp.zeros_like(b.delta))


@dataclasses.dataclass(frozen=True)
class SparseModeRule:
    """What one sparse mode means and needs."""

    mode: SparseMode
    name: str  # the NPU's name
    band: Callable  # band(BandInputs) -> (lo, hi, floor) per sequence
    mask_required: bool = False  # atten_mask must be given
    compressed_mask: tuple | None = None  # the only atten_mask shape accepted (then ignored)
    token_rule: str = "ignored"  # "ignored" | "band" | "band_with_mask" | "edge_last" | "edge_first"
    layouts: str = "any"  # "any" | "padded" (not TND) | "TND" (varlen only)
    needs_prefix: bool = False
    # Context parallelism (Sq == Skv): the top-left window (pre, next) it is, or None.
    top_left_window: Callable | None = None
    varlen_cut_mode: int | None = None  # the mode a sequence-parallel cut of it becomes
    npu: str = ""  # how the NPU operator is called for it

    @property
    def element_mask(self) -> bool:
        """atten_mask is an element mask (not the compressed form)."""
        return self.compressed_mask is None


_INF = float("inf")

RULES = {rule.mode: rule for rule in (
    SparseModeRule(SparseMode.DEFAULT_MASK, "defaultMask", _band_default,
                   token_rule="band_with_mask", top_left_window=lambda pre, nxt: (_INF, _INF),
                   npu="optional element mask; pre/next passed"),
    SparseModeRule(SparseMode.ALL_MASK, "allMask", _band_all, mask_required=True,
                   npu="element mask required"),
    SparseModeRule(SparseMode.LEFT_UP_CAUSAL, "leftUpCausal", _band_left_up_causal,
                   compressed_mask=COMPRESSED_CAUSAL, top_left_window=lambda pre, nxt: (_INF, 0),
                   varlen_cut_mode=SparseMode.BAND_LEFT_UP_CAUSAL,
                   npu="compressed 2048x2048 mask"),
    SparseModeRule(SparseMode.RIGHT_DOWN_CAUSAL, "rightDownCausal", _band_right_down_causal,
                   compressed_mask=COMPRESSED_CAUSAL, top_left_window=lambda pre, nxt: (_INF, 0),
                   varlen_cut_mode=SparseMode.RIGHT_DOWN_CAUSAL_BAND,
                   npu="compressed 2048x2048 mask"),
    SparseModeRule(SparseMode.BAND, "band", _band_band, compressed_mask=COMPRESSED_CAUSAL,
                   token_rule="band", top_left_window=lambda pre, nxt: (pre, nxt),
                   npu="compressed 2048x2048 mask; pre/next passed"),
    SparseModeRule(SparseMode.PREFIX, "prefix", _band_prefix, mask_required=True,
                   layouts="padded", needs_prefix=True,
                   npu="element mask required; prefix per batch"),
    SparseModeRule(SparseMode.PREFIX_COMPRESS, "prefixCompress", _band_prefix,
                   compressed_mask=COMPRESSED_PREFIX, needs_prefix=True,
                   npu="compressed 3072x2048 mask; prefix per batch"),
    SparseModeRule(SparseMode.RIGHT_DOWN_CAUSAL_BAND, "rightDownCausal_band",
                   _band_right_down_causal_band, compressed_mask=COMPRESSED_CAUSAL,
                   token_rule="edge_last", layouts="TND",
                   npu="compressed 2048x2048 mask; pre/next passed"),
    SparseModeRule(SparseMode.BAND_LEFT_UP_CAUSAL, "band_leftUpCausal",
                   _band_band_left_up_causal, compressed_mask=COMPRESSED_CAUSAL,
                   token_rule="edge_first", layouts="TND",
                   npu="compressed 2048x2048 mask; pre/next passed"),
)}


def rule(mode: int) -> SparseModeRule:
    """The record of sparse mode `mode` (a validated int in 0..8)."""
    return RULES[SparseMode(mode)]
