"""The rules of spec/attention.md that depend on the values of actual_seq_qlen,
actual_seq_kvlen and prefix: cumulative lengths inside the tensors, a TND mask
that covers every sequence, the band rules per sequence, the mode 7/8 token
rules and the prefix range.

`ValueChecks(...)(qlen, kvlen, prefix)` runs them on whatever is concrete: at
trace time on concrete arguments (options.attention_call), and at run time on
the host values of traced ones (ops.prepare through core/runtime_checks.py),
so both raise the same ValueError, naming the argument.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_rope.attention import sparse_modes

INT32_MIN, INT32_MAX = -2147483648, 2147483647


def concrete(x):
    """NumPy int64 values of x, or None when x is None or traced."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x).astype(np.int64).reshape(-1)


def check_int32_range(name, values) -> None:
    if values.size and (values.min() < INT32_MIN or values.max() > INT32_MAX):
        raise ValueError(f"{name} values must fit in int32 [{INT32_MIN}, {INT32_MAX}], "
                         f"got {values.tolist()}")


def _check_band(pre, nxt, q_len, kv_len, where):
    if pre < 0 and nxt < 0:
        raise ValueError(f"pre_tokens and next_tokens must not both be negative{where}, "
                         f"got {pre} and {nxt}")
    if pre < 0 and not (nxt >= -pre and -pre < kv_len):
        raise ValueError(f"pre_tokens {pre} < 0 needs next_tokens >= {-pre} and "
                         f"-pre_tokens < Skv={kv_len}{where}, got next_tokens {nxt}")
    if nxt < 0 and not (-nxt <= pre and -nxt < q_len):
        raise ValueError(f"next_tokens {nxt} < 0 needs pre_tokens >= {-nxt} and "
                         f"-next_tokens < Sq={q_len}{where}, got pre_tokens {pre}")


@dataclasses.dataclass(frozen=True)
class ValueChecks:
    """The value rules of one call (static parts only: hashable, no arrays)."""

    mode: int
    pre: int
    nxt: int
    varlen: bool
    batch: int  # sequences
    q_len: int  # Sq, or Tq for TND
    kv_len: int
    tnd_mask_shape: tuple | None  # (rows, cols) of a TND element mask
    has_user_mask: bool
    compressed_width: int | None = None  # W of a TND compressed 1024-row pse

    def pairs(self, actual_seq_qlen=None, actual_seq_kvlen=None):
        """(Sq, Skv) per sequence (one pair for the padded layouts), None while traced."""
        return self._pairs(actual_seq_qlen, actual_seq_kvlen)

    def __call__(self, actual_seq_qlen=None, actual_seq_kvlen=None, prefix=None) -> None:
        pairs = self._pairs(actual_seq_qlen, actual_seq_kvlen)
        if pairs is not None and self.tnd_mask_shape is not None:
            rows, cols = self.tnd_mask_shape
            if pairs and (rows < max(p[0] for p in pairs) or cols < max(p[1] for p in pairs)):
                raise ValueError(f"atten_mask must be (maxSq, maxSkv) covering every sequence of "
                                 f"actual_seq_qlen/actual_seq_kvlen, got shape {(rows, cols)}")
        self._tokens(pairs)
        self._prefix(prefix, pairs)
        if pairs is not None and self.compressed_width is not None:
            if any(a != b for a, b in pairs):
                raise ValueError("the compressed 1024-row pse needs equal query and key lengths "
                                 f"in every sequence, got {pairs}")
            widest = max((b for _, b in pairs), default=0)
            if widest != self.compressed_width:
                raise ValueError(f"the compressed 1024-row pse must have max_b Skv_b = {widest} "
                                 f"columns, got {self.compressed_width}")

    def _pairs(self, actual_seq_qlen, actual_seq_kvlen):
        """(Sq, Skv) per sequence (one pair for the padded layouts), None while traced."""
        if not self.varlen:
            return [(self.q_len, self.kv_len)]
        lengths = []
        for name, x, total in (("actual_seq_qlen", actual_seq_qlen, self.q_len),
                               ("actual_seq_kvlen", actual_seq_kvlen, self.kv_len)):
            values = concrete(x)
            if values is not None:
                check_int32_range(name, values)
                if values.min() < 0 or np.any(np.diff(values) < 0) or values[-1] > total:
                    raise ValueError(f"{name} must be non-decreasing cumulative ends in "
                                     f"[0, {total}], got {values.tolist()}")
                values = np.diff(values, prepend=0)
            lengths.append(values)
        if lengths[0] is None or lengths[1] is None:
            return None
        return [(int(a), int(b)) for a, b in zip(*lengths)]

    def _tokens(self, pairs):
        """The band rules after conversion to top-left, and the mode 7/8 rules."""
        mode, pre, nxt = self.mode, self.pre, self.nxt
        token_rule = sparse_modes.rule(mode).token_rule
        is_band = token_rule == "band" or (token_rule == "band_with_mask" and self.has_user_mask)
        if pairs is None:  # traced varlen lengths: only what needs no length
            if is_band and pre < 0 and nxt < 0:
                _check_band(pre, nxt, 1, 1, "")
            return
        if is_band:
            for idx, (sq, skv) in enumerate(pairs):
                if sq == 0 or skv == 0:
                    continue
                delta = skv - sq if token_rule == "band" else 0  # band: bottom-right aligned
                where = f" (sequence {idx})" if len(pairs) > 1 else ""
                _check_band(pre - delta, nxt + delta, sq, skv, where)
        if token_rule in ("edge_last", "edge_first"):
            nonempty = [p for p in pairs if p[0] > 0]
            if not nonempty:
                return
            last = token_rule == "edge_last"
            sq, skv = nonempty[-1] if last else nonempty[0]
            which = "last" if last else "first"
            if pre < skv:
                raise ValueError(f"pre_tokens must be >= the {which} sequence's Skv={skv} "
                                 f"in sparse_mode {mode}, got {pre}")
            low, high = sq - skv, (0 if last else None)
            if nxt < low or (high is not None and nxt > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"next_tokens must be {bound} (from the {which} sequence, "
                                 f"Sq={sq}, Skv={skv}) in sparse_mode {mode}, got {nxt}")

    def _prefix(self, prefix, pairs):
        values = concrete(prefix)
        if values is None or pairs is None:
            return
        check_int32_range("prefix", values)
        if len(pairs) == 1:
            pairs = pairs * self.batch
        for b, (value, (sq, skv)) in enumerate(zip(values, pairs)):
            if not max(skv - sq, 0) <= value <= skv:
                raise ValueError(f"prefix[{b}] must be in [{max(skv - sq, 0)}, {skv}], "
                                 f"got {int(value)}")
