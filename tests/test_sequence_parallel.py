"""varlen_sequence_parallel_split: the worked examples of spec/attention.md and random
packed batches whose per-shard results concatenate to the uncut attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr


def test_mode7_worked_example():
    # Uncut: sequences 3x3, the 4x6 rightDownCausal one, 5x5, 4x4; cut after 5 query tokens.
    shards = jr.varlen_sequence_parallel_split([3, 7, 12, 16], [3, 9, 14, 18], 2, 3, cuts=[5])
    one, two = shards
    assert (one.actual_seq_qlen, one.actual_seq_kvlen) == ((3, 5), (3, 9))
    assert (one.sparse_mode, one.pre_tokens, one.next_tokens) == (7, 6, -2)
    assert (two.actual_seq_qlen, two.actual_seq_kvlen, two.sparse_mode) == (
        (2, 7, 11), (6, 11, 15), 3)
    assert (one.q_start, one.q_end, one.kv_start, one.kv_end) == (0, 5, 0, 9)
    assert (two.q_start, two.q_end, two.kv_start, two.kv_end) == (5, 16, 3, 18)


def test_mode8_worked_example():
    # Uncut: 3x3, the 5x4 leftUpCausal one, 5x5, 4x4; cut after 5 query tokens.
    one, two = jr.varlen_sequence_parallel_split([3, 8, 13, 17], [3, 7, 12, 16], 2, 2, cuts=[5])
    assert (one.actual_seq_qlen, one.actual_seq_kvlen, one.sparse_mode) == ((3, 5), (3, 7), 2)
    assert (two.actual_seq_qlen, two.actual_seq_kvlen) == ((3, 8, 12), (4, 9, 13))
    assert (two.sparse_mode, two.pre_tokens, two.next_tokens) == (8, 4, 1)


def _check_split(rng, q_lens, kv_lens, shards, mode, cuts=None, backend="fallback"):
    qc, kc = np.cumsum(q_lens).tolist(), np.cumsum(kv_lens).tolist()
    tq, tk = qc[-1], kc[-1]
    q = jnp.asarray(rng.standard_normal((tq, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((tk, 1, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tk, 1, 8)), jnp.float32)
    with jr.backend(backend):
        ref = jr.flash_attention_score(q, k, v, input_layout="TND", sparse_mode=mode,
                                       actual_seq_qlen=qc, actual_seq_kvlen=kc)[0]
        parts = []
        for s in jr.varlen_sequence_parallel_split(qc, kc, shards, mode, cuts=cuts):
            if s.q_end == s.q_start:
                continue
            if s.kv_end == s.kv_start:  # every row of the piece sees no key
                parts.append(np.zeros((s.q_end - s.q_start, 2, 8), np.float32))
                continue
            parts.append(jr.flash_attention_score(
                q[s.q_start:s.q_end], k[s.kv_start:s.kv_end], v[s.kv_start:s.kv_end],
                input_layout="TND", sparse_mode=s.sparse_mode, pre_tokens=s.pre_tokens,
                next_tokens=s.next_tokens, actual_seq_qlen=list(s.actual_seq_qlen),
                actual_seq_kvlen=list(s.actual_seq_kvlen))[0])
    np.testing.assert_allclose(np.concatenate(parts), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [2, 3])
def test_worked_examples_concatenate(mode):
    rng = np.random.default_rng(0)
    if mode == 3:
        _check_split(rng, [3, 4, 5, 4], [3, 6, 5, 4], 2, 3, cuts=[5])
    else:
        _check_split(rng, [3, 5, 5, 4], [3, 4, 5, 4], 2, 2, cuts=[5])


@pytest.mark.parametrize("seed", range(6))
def test_random_packed_batches(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    q_lens = rng.integers(0, 9, n)
    q_lens[rng.integers(n)] += 6  # at least one long sequence, often cut several times
    kv_lens = np.maximum(q_lens + rng.integers(-3, 5, n), 0) if seed % 3 else q_lens
    shards = int(rng.integers(2, 6))
    mode = 2 + seed % 2
    _check_split(rng, q_lens, kv_lens, shards, mode,
                 backend="ffi" if seed % 3 else "fallback")


def test_one_sequence_across_many_shards():
    rng = np.random.default_rng(7)
    _check_split(rng, [17], [20], 5, 2)
    _check_split(rng, [17], [13], 4, 3)  # the first rows see no key: truncated key ranges


@pytest.mark.parametrize("total,shards", [(16, 2), (17, 5), (3, 4), (0, 3)])
def test_default_pieces_are_about_equal(total, shards):
    pieces = jr.varlen_sequence_parallel_split([total], [total], shards, 3)
    sizes = [s.q_end - s.q_start for s in pieces]
    assert pieces[0].q_start == 0 and pieces[-1].q_end == total
    assert all(a.q_end == b.q_start for a, b in zip(pieces, pieces[1:]))
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1


def test_cuts_choose_the_pieces():
    pieces = jr.varlen_sequence_parallel_split([3, 7, 12, 16], [3, 9, 14, 18], 3, 3,
                                               cuts=[5, 5])
    assert [(s.q_start, s.q_end) for s in pieces] == [(0, 5), (5, 5), (5, 16)]
    with pytest.raises(ValueError, match="cuts"):
        jr.varlen_sequence_parallel_split([16], [16], 3, 2, cuts=[9, 4])
    with pytest.raises(ValueError, match="cuts"):
        jr.varlen_sequence_parallel_split([16], [16], 3, 2, cuts=[4])


def test_validation():
    with pytest.raises(ValueError, match="sparse_mode"):
        jr.varlen_sequence_parallel_split([4], [4], 2, 4)
    with pytest.raises(ValueError, match="cuts"):
        jr.varlen_sequence_parallel_split([4], [4], 2, 2, cuts=[5])
    with pytest.raises(ValueError, match="num_shards"):
        jr.varlen_sequence_parallel_split([4], [4], 0, 2)
    s = jr.varlen_sequence_parallel_split([4], [4], 2, 2)[0]
    with pytest.raises(dataclasses_error()):
        s.q_start = 1


def dataclasses_error():
    import dataclasses
    return dataclasses.FrozenInstanceError
