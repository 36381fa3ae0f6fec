"""Sequence-parallel cuts of packed (TND) causal attention with sparse modes 7 and 8.

`varlen_sequence_parallel_split` cuts the packed query tokens into contiguous
pieces, one per shard (about equal sizes, or at the caller's `cuts`); a sequence
may be cut, across any number of shards. Each
shard gets the key/value tokens its rows can see (one contiguous range; ranges
of neighbouring shards overlap on a cut sequence) and the TND arguments that
make `flash_attention_score` on its slices give exactly its rows of the uncut
result (spec/attention.md, sparse modes 7 and 8):

- rightDownCausal (3): a piece that ends before its sequence does (the shard's
  last sequence) keeps the sequence's whole key range and carries the band
  `next_tokens = rows_end - Sq`, `pre_tokens = Skv`: mode 7. A piece that
  starts inside its sequence and runs to its end is rightDownCausal as it is.
- leftUpCausal (2): a piece that starts inside its sequence (the shard's first
  sequence) carries the band `next_tokens = rows_start - (Skv - rows)`,
  `pre_tokens = Skv`: mode 8. A piece that ends early is leftUpCausal as it is.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_rope.attention import sparse_modes
from jax_rope.attention.options import MAX_TOKENS
from jax_rope.attention.value_checks import check_int32_range


@dataclasses.dataclass(frozen=True)
class SequenceParallelShard:
    """One shard's slices and TND arguments for `flash_attention_score`."""

    q_start: int  # packed query tokens [q_start, q_end)
    q_end: int
    kv_start: int  # packed key/value tokens [kv_start, kv_end)
    kv_end: int
    actual_seq_qlen: tuple  # cumulative, relative to the shard
    actual_seq_kvlen: tuple
    sparse_mode: int  # 2, 3, 7 or 8
    pre_tokens: int
    next_tokens: int


_CUTTABLE = [int(m) for m, r in sparse_modes.RULES.items() if r.varlen_cut_mode is not None]


def _integers(name, values):
    """values as int64, refusing traced values and non-integer dtypes (nothing is truncated)
    and values beyond int32."""
    if isinstance(values, jax.core.Tracer):
        raise TypeError(f"{name} must be concrete values (the split is computed on the host), "
                        "got a traced array")
    array = np.asarray(values)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        if array.size or array.dtype != np.float64:  # [] reads as float64: empty, not float
            raise TypeError(f"{name} must be integers, got dtype {array.dtype.name}")
    array = array.astype(np.int64).reshape(-1)
    check_int32_range(name, array)
    return array


def _cumulative(name, values):
    values = _integers(name, values)
    if values.size == 0 or values.min() < 0 or np.any(np.diff(values) < 0):
        raise ValueError(f"{name} must be non-empty non-decreasing cumulative lengths, "
                         f"got {values.tolist()}")
    return values


def _shard(q_ends, kv_ends, start, end, mode):
    q_starts = np.concatenate([[0], q_ends[:-1]])
    kv_starts = np.concatenate([[0], kv_ends[:-1]])
    touched = [b for b in range(len(q_ends)) if q_starts[b] < end and q_ends[b] > start]
    if not touched:
        return SequenceParallelShard(start, end, 0, 0, (0,), (0,), mode, MAX_TOKENS, MAX_TOKENS)
    first, last = touched[0], touched[-1]
    q_lens, kv_lens = [], []
    for b in range(first, last + 1):
        r0 = max(start, q_starts[b]) - q_starts[b]
        r1 = min(end, q_ends[b]) - q_starts[b]
        q_lens.append(int(max(r1 - r0, 0)))
        kv_lens.append(int(kv_ends[b] - kv_starts[b]))
    kv_start, kv_end = int(kv_starts[first]), int(kv_ends[last])
    shard_mode, pre, nxt = mode, MAX_TOKENS, MAX_TOKENS
    cut_mode = sparse_modes.rule(mode).varlen_cut_mode  # the band mode a cut piece becomes
    carrier = sparse_modes.rule(cut_mode).token_rule  # which sequence carries its band
    seq_q, seq_kv = int(q_ends[first] - q_starts[first]), kv_lens[0]
    if carrier == "edge_first" and start > q_starts[first]:  # first sequence starts inside
        r0 = int(start - q_starts[first])
        shard_mode, pre, nxt = int(cut_mode), seq_kv, r0 - (seq_kv - q_lens[0])
    seq_q, seq_kv = int(q_ends[last] - q_starts[last]), kv_lens[-1]
    if carrier == "edge_last" and end < q_ends[last]:  # last sequence ends in a later shard
        r0 = int(max(start, q_starts[last]) - q_starts[last])
        r1 = int(end - q_starts[last])
        if r0 >= seq_q - seq_kv:  # the cut mode's rule Sq - Skv <= next_tokens
            shard_mode, pre, nxt = int(cut_mode), seq_kv, r1 - seq_q
        else:  # rows that see fewer keys than the band allows: keep only the visible keys
            visible = int(min(max(r1 + seq_kv - seq_q, 0), seq_kv))
            kv_lens[-1] = visible
            kv_end = int(kv_starts[last]) + visible
    return SequenceParallelShard(int(start), int(end), kv_start, kv_end,
                                 tuple(int(x) for x in np.cumsum(q_lens)),
                                 tuple(int(x) for x in np.cumsum(kv_lens)), shard_mode, pre, nxt)


def varlen_sequence_parallel_split(actual_seq_qlen, actual_seq_kvlen, num_shards, sparse_mode,
                                   *, cuts=None):
    """Cuts packed causal attention into `num_shards` query pieces.

    Args:
      actual_seq_qlen, actual_seq_kvlen: the uncut cumulative TND lengths (concrete).
      num_shards: number of contiguous query pieces.
      sparse_mode: 2 (leftUpCausal) or 3 (rightDownCausal) of the uncut call.
      cuts: where the pieces meet, as packed query token positions: num_shards - 1
        non-decreasing ints in [0, Tq]; the first piece starts at 0, the last ends
        at Tq, equal neighbouring cuts give an empty piece. E.g. cuts=[5] with
        Tq = 16: pieces [0, 5) and [5, 16). None (the default): pieces of about
        equal size, differing by at most one token,
        piece p = [p * Tq // num_shards, (p + 1) * Tq // num_shards).
        Pass cuts to cut where a plan needs it: the worked examples of
        spec/attention.md cut after 5 of 16 tokens, and under a causal mask equal
        token counts are not equal work (later rows see more keys).

    Returns:
      A list of `SequenceParallelShard`, one per shard: flash_attention_score(
      q[q_start:q_end], k[kv_start:kv_end], v[kv_start:kv_end], input_layout="TND",
      actual_seq_qlen=..., actual_seq_kvlen=..., sparse_mode=..., pre_tokens=...,
      next_tokens=...) for every shard, concatenated along tokens, equals the uncut call
      on tokens [0, Tq), Tq = actual_seq_qlen[-1].
    """
    q_ends = _cumulative("actual_seq_qlen", actual_seq_qlen)
    kv_ends = _cumulative("actual_seq_kvlen", actual_seq_kvlen)
    if q_ends.shape != kv_ends.shape:
        raise ValueError(f"actual_seq_kvlen must have the length of actual_seq_qlen "
                         f"{q_ends.size}, got {kv_ends.size}")
    if sparse_mode not in _CUTTABLE:
        raise ValueError(f"sparse_mode must be 2 or 3 (the uncut causal mode), got {sparse_mode!r}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) \
            or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    total = int(q_ends[-1])
    if cuts is None:
        cuts = [p * total // num_shards for p in range(1, num_shards)]
    cuts = [int(c) for c in _integers("cuts", cuts)]
    bounds = [0] + cuts + [total]
    if len(cuts) != num_shards - 1 or any(a > b for a, b in zip(bounds, bounds[1:])) \
            or not 0 <= min(bounds) <= max(bounds) <= total:
        raise ValueError(f"cuts must be {num_shards - 1} non-decreasing positions in "
                         f"[0, {total}], got {cuts}")
    return [_shard(q_ends, kv_ends, a, b, sparse_mode) for a, b in zip(bounds, bounds[1:])]
