"""The CPU kernels' fast paths against the float64 oracle (tests/attention_oracle.py): the
flash-decoding forward for short query blocks (head groups G = N1 / N2 packed into one tile,
key axis split into fixed chunks merged in order) with its dot-product and GEMM score
routines, every sparse mode that allows Sq = 1, head dims 64/128/256/40 and Dv < D, bfloat16
inputs, and ffi against the jax.numpy fallback with ALiBi and dropout. Keys run past one
chunk (1024) so the merge is exercised. Also the tiled forward's items and the backward's
paths, and user masks that leave whole tiles masked or clear."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import attention_oracle as ao
import jax_rope as jr
from attention_oracle import f64

TOL = {"float32": (2e-5, 2e-5), "bfloat16": (1e-2, 1e-2)}


def _rng(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _check(args, kw):
    """ffi forward (and the same call again: same bits) against the oracle."""
    f = jax.jit(functools.partial(jr.flash_attention_score, **kw))
    with jr.backend("ffi"):
        got = [np.asarray(o) for o in f(*(jnp.asarray(a) for a in args))]
        again = [np.asarray(o) for o in f(*(jnp.asarray(a) for a in args))]
    for g, a in zip(got, again):
        np.testing.assert_array_equal(g, a)
    layout = kw.get("input_layout", "BSND")
    ref = ao.flash_attention_score(*(f64(a) for a in args), **ao.ref_kwargs(kw))
    rtol, atol = TOL[np.dtype(args[0].dtype).name]
    stats = (lambda s: s.T[None]) if layout == "TND" else (lambda s: s)
    dead = stats(ref[1]) == ao.FLOAT32_LOWEST
    out, mx, sm = got
    assert not np.isnan(f64(out)).any()
    o4 = ao.to_bnsd(out, layout, dead.shape[1])
    assert np.all(o4[dead] == 0)
    np.testing.assert_array_equal(stats(mx)[dead], ao.FLOAT32_LOWEST)
    np.testing.assert_array_equal(stats(sm)[dead], ao.FLOAT32_MAX)
    np.testing.assert_allclose(f64(out), ref[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(stats(mx)[~dead], stats(ref[1])[~dead], rtol=rtol, atol=atol)
    np.testing.assert_allclose(stats(sm)[~dead], stats(ref[2])[~dead], rtol=rtol, atol=atol)


# (D, Dv, G, Sq): dot scores for G * Sq <= 16, GEMM scores above; odd D; Dv < D.
@pytest.mark.parametrize("d,dv,group,sq", [
    (128, 128, 4, 1), (64, 64, 1, 1), (256, 256, 2, 1), (40, 40, 8, 1), (64, 32, 4, 3),
    (40, 24, 2, 20), (128, 128, 8, 8)])
def test_short_queries_shapes(d, dv, group, sq):
    rng = _rng(d, dv, group, sq)
    args, kw = ao.make_case(rng, B=2, Sq=sq, Skv=1100, N1=2 * group, N2=2, D=d, Dv=dv,
                            sparse_mode=3)
    _check(args, kw)


@pytest.mark.parametrize("mode", [0, "0-mask", 1, 2, 3, 4, 5, 6])
def test_decode_sparse_modes(mode):
    rng = _rng("mode", mode)
    sq, skv, b = 1, 1030, 2
    m = 0 if mode == "0-mask" else mode
    kw = ao.mode_kwargs(m, rng, b, sq, skv)
    if mode == 0:
        kw.pop("atten_mask", None)
    if mode == 1:
        kw["atten_mask"] = ao.random_atten_mask(rng, (b, 1, sq, skv), 0.3)
    args, kw2 = ao.make_case(rng, B=b, Sq=sq, Skv=skv, N1=4, N2=1, D=64, **kw)
    _check(args, kw2)


@pytest.mark.parametrize("mode", [7, 8])
def test_decode_varlen(mode):
    rng = _rng("tnd", mode)
    lq, lkv = [1, 0, 2, 1], [1200, 7, 40, 1030]
    args, kw = ao.make_case(rng, "TND", N1=4, N2=2, D=64, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    _check(args, kw)


# Batched decoding with a padding mask: the key blocks past a sequence's length are masked for
# every head of a run and skipped; a sequence with no key left is a dead row.
@pytest.mark.parametrize("sq,group,mask_heads", [(1, 4, 1), (3, 2, 1), (1, 2, 4)])
def test_decode_padding_mask(sq, group, mask_heads):
    rng = _rng("padding", sq, group, mask_heads)
    b, skv = 4, 2100
    lens = np.array([2100, 700, 0, 1500])
    pad = np.arange(skv)[None, :] >= lens[:, None]
    mask = np.broadcast_to(pad[:, None, None, :], (b, mask_heads, sq, skv)).copy()
    if mask_heads > 1:  # one head of the first sequence sees only its first 300 keys
        mask[0, 1, :, 300:] = True
    args, kw = ao.make_case(rng, B=b, Sq=sq, Skv=skv, N1=2 * group, N2=2, D=64,
                            sparse_mode=1, atten_mask=mask)
    _check(args, kw)


def test_decode_bfloat16():
    rng = _rng("bf16")
    args, kw = ao.make_case(rng, "BSND", ml_dtypes.bfloat16, B=2, Sq=1, Skv=1500, N1=8, N2=2, D=128,
                            sparse_mode=3)
    _check(args, kw)


# The decode path reads K and V rows in memory order: the same rows of a run of kv heads in
# turn where a row's heads lie together (BSND, BSH, SBH, TND), one head's rows at a time where
# they do not (BNSD); dot scores (G * Sq <= 16) and GEMM scores.
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH", "TND"])
@pytest.mark.parametrize("group,sq", [(4, 1), (8, 3)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_decode_layouts(layout, group, sq, dtype):
    rng = _rng("layout", layout, group, sq, np.dtype(dtype).name)
    if layout == "TND":
        args, kw = ao.make_case(rng, "TND", dtype, N1=4 * group, N2=4, D=64, seq_q=[sq, sq],
                                seq_kv=[1100, 700], sparse_mode=3)
    else:
        args, kw = ao.make_case(rng, layout, dtype, B=2, Sq=sq, Skv=1100, N1=4 * group, N2=4,
                                D=64, sparse_mode=3)
    _check(args, kw)


# Runs whose V blocks are larger than a quarter of the L2 (AskValuesBytes; 256 KiB with this
# machine type's 1 MiB): the dot scores do not ask for the V rows but for K rows a few steps
# ahead of their own (NextKeyRows). 128 items (B16 x N2=8, one chunk each) go to two threads
# in ranges of 4, runs of 4 kv heads: 512 KiB of V per key block at D = 512 in float32, and
# at D = 1024 in bfloat16.
@pytest.mark.parametrize("dtype, d", [(np.float32, 512), (ml_dtypes.bfloat16, 1024)])
def test_decode_runs_too_large_to_wait_in_l2(dtype, d):
    rng = _rng("large runs", np.dtype(dtype).name)
    args, kw = ao.make_case(rng, "BSND", dtype, B=16, Sq=1, Skv=130, N1=16, N2=8, D=d,
                            sparse_mode=3)
    _check(args, kw)


@pytest.mark.parametrize("n2,layout", [(1, "BSND"), (4, "BSND"), (4, "BNSD")])
def test_masked_kv_rows_do_not_leak(n2, layout):
    """NaN/Inf in key/value rows that the band masks out (keys 0-598; the block from key 576
    is partly visible) leave the output finite."""
    rng = _rng("nan", n2, layout)
    args, kw = ao.make_case(rng, layout, B=1, Sq=1, Skv=1100, N1=4 * n2, N2=n2, D=64,
                            sparse_mode=4, pre_tokens=500, next_tokens=0)
    k, v = args[1].copy(), args[2].copy()
    seq = (slice(None), slice(None), slice(0, 599)) if layout == "BNSD" else \
        (slice(None), slice(0, 599))
    k[seq] = np.nan
    v[seq] = np.inf
    with jr.backend("ffi"):
        out = np.asarray(jr.flash_attention_score(*(jnp.asarray(a) for a in (args[0], k, v)),
                                                  **kw)[0])
    ref = ao.flash_attention_score(f64(args[0]), f64(args[1]), f64(args[2]), **kw)[0]
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_bias_dropout_ffi_matches_fallback():
    """ALiBi and dropout through the decode path: the same numbers as the jax.numpy fallback."""
    rng = _rng("alibi")
    args, kw = ao.make_case(rng, B=2, Sq=1, Skv=1100, N1=8, N2=2, D=64, sparse_mode=3)
    slopes = jnp.asarray(2.0 ** (-np.arange(1, 9)), jnp.float32)
    f = functools.partial(jr.flash_attention_score, pse=slopes, pse_type=2, keep_prob=0.9,
                          dropout_key=jax.random.key(0), **kw)
    got = {}
    for backend in ("ffi", "fallback"):
        with jr.backend(backend):
            got[backend] = [np.asarray(o) for o in f(*(jnp.asarray(a) for a in args))]
    for a, b in zip(got["ffi"], got["fallback"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


# Forward items take up to four query heads of a kv head's group over one key loop (each
# K/V block read once for all of them): group sizes 4, 6 (two heads per item), 1 and 3.
@pytest.mark.parametrize("group,sq,mode", [(4, 96, 3), (6, 70, 2), (1, 130, 2), (3, 80, 0)])
def test_grouped_forward_items(group, sq, mode):
    rng = _rng("group", group, sq, mode)
    args, kw = ao.make_case(rng, B=2, Sq=sq, Skv=200, N1=2 * group, N2=2, D=64,
                            sparse_mode=mode)
    _check(args, kw)


# Where up to 16 lanes hold every query block of a head group, and that leaves four items per
# worker, one item takes them all (each K/V block is read by one item): on two workers these
# shapes do (key_value_copy_test counts the items), with more they take items of 8 lanes.
@pytest.mark.parametrize("group,n2,sq", [(4, 4, 200), (1, 8, 600)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_forward_items_spanning_head_groups(group, n2, sq, dtype):
    rng = _rng("wide", group, n2, sq, np.dtype(dtype).name)
    args, kw = ao.make_case(rng, dtype=dtype, B=2, Sq=sq, Skv=sq + 40, N1=group * n2, N2=n2,
                            D=64, sparse_mode=3)
    _check(args, kw)


# Once every query of a forward lane has a shift (its largest score so far), a tile without
# masked positions takes its softmax terms from the score product under that shift, kept
# while the tile's scores stay within 5.5 of it (the statistics are raised to each row's
# largest score at the end); a tile rising further is multiplied again and steps as before.
# Key blocks scaled to make the scores rise a little, jump far past the shift and fall; then
# a NaN key in a late block, which every row that sees it turns NaN.
@pytest.mark.parametrize("mode", [0, 3])
def test_forward_scores_rising_past_shift(mode):
    rng = _rng("rising", mode)
    args, kw = ao.make_case(rng, B=1, Sq=640, Skv=640, N1=2, N2=2, D=64, sparse_mode=mode)
    k = args[1]
    k[:, 128:192] *= 2.0
    k[:, 320:384] *= 30.0
    k[:, 448:512] *= 0.1
    _check(args, kw)
    k[:, 500, 1] = np.nan
    with jr.backend("ffi"):
        out = np.asarray(jr.flash_attention_score(*(jnp.asarray(a) for a in args), **kw)[0])
    first = 0 if mode == 0 else 500  # the first row that sees key 500
    assert np.isnan(out[:, first:, 1]).all()
    assert not np.isnan(out[:, :, 0]).any() and not np.isnan(out[:, :first, 1]).any()


@pytest.mark.parametrize("sq,group", [(1, 1), (3, 2), (80, 4)])
def test_nan_key_seen_alone_gives_nan(sq, group):
    """A row whose only visible key is NaN gets a NaN output (not a dead row's zeros):
    the split decode path (Sq * G <= 64) and the block path."""
    rng = _rng("nan-alone", sq, group)
    args, kw = ao.make_case(rng, B=1, Sq=sq, Skv=sq, N1=group, N2=1, D=64, sparse_mode=2)
    k = args[1].copy()
    k[:, 0] = np.nan
    with jr.backend("ffi"):
        out = np.asarray(jr.flash_attention_score(jnp.asarray(args[0]), jnp.asarray(k),
                                                  jnp.asarray(args[2]), **kw)[0])
    assert np.isnan(out).all()  # row 0 sees only key 0; later rows sum over it


# The backward over (sequence, kv head) items when they keep the threads busy (dquery summed
# in the key-block pass), else over key blocks and query blocks: both against the oracle.
@pytest.mark.parametrize("b,n1,n2", [(4, 8, 4), (1, 2, 1), (2, 6, 2)])
def test_backward_paths_against_oracle(b, n1, n2):
    rng = _rng("bwd", b, n1, n2)
    args, kw = ao.make_case(rng, B=b, Sq=100, Skv=140, N1=n1, N2=n2, D=64, sparse_mode=3)
    _check_grads(rng, args, kw)


# The fused backward takes key blocks four at a time: six key blocks (a full step and a part of
# one) under a causal band and a window, whose key blocks each see other query blocks.
@pytest.mark.parametrize("mode_kw", [dict(sparse_mode=3),
                                     dict(sparse_mode=4, pre_tokens=100, next_tokens=0)])
def test_backward_key_block_steps_against_oracle(mode_kw):
    rng = _rng("bwd-steps", *mode_kw.values())
    args, kw = ao.make_case(rng, B=2, Sq=300, Skv=330, N1=4, N2=2, D=16, **mode_kw)
    _check_grads(rng, args, kw)


def _check_grads(rng, args, kw):
    """ffi gradients for a random dout against the oracle's."""
    dout = rng.standard_normal(args[0].shape).astype(np.float32)
    f = lambda q, k, v: jr.flash_attention_score(q, k, v, **kw)[0]
    with jr.backend("ffi"):
        _, pullback = jax.vjp(f, *(jnp.asarray(a) for a in args))
        got = [np.asarray(g) for g in pullback(jnp.asarray(dout))]
    ref = ao.flash_attention_grad(*(f64(a) for a in args), f64(dout), **ao.ref_kwargs(kw))
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def _structured_mask(rng, b, heads, sq, skv):
    """A user mask (True = masked) whose 64 x 64 tiles are masked throughout, clear, or mixed:
    two documents (queries [0, 70) see keys [0, 90), the rest keys [90, skv)), keys past 230
    padding in the second sequence, a random patch in the first, and dead rows (190-199) in
    the second."""
    q, k = np.arange(sq)[:, None], np.arange(skv)[None, :]
    doc = (q < 70) != (k < 90)
    m = np.broadcast_to(doc, (b, heads, sq, skv)).copy()
    m[0, :, 130:150, 100:120] |= rng.random((heads, 20, 20)) < 0.3
    if b > 1:
        m[1, :, :, 230:] = True
        m[1, :, 190:, :] = True
    if heads > 1:  # per-head masks differ
        m[:, 1:, 0:40, 0:30] = True
    return m


# A user mask (sparse_mode 1) over several tiles: the kernels skip the tiles it masks
# throughout, mask the band alone on the ones it leaves clear, and mask element by element on
# the rest, forward and backward (fused: B * N2 items fill both threads; two-pass: one item).
@pytest.mark.parametrize("b,n1,n2,mask_heads", [(2, 4, 2, 1), (1, 3, 1, 3), (2, 2, 2, 2)])
def test_user_mask_tiles_against_oracle(b, n1, n2, mask_heads):
    rng = _rng("user-mask", b, n1, n2, mask_heads)
    mask = _structured_mask(rng, b, mask_heads, 200, 260)
    args, kw = ao.make_case(rng, B=b, Sq=200, Skv=260, N1=n1, N2=n2, D=64, sparse_mode=1,
                            atten_mask=mask)
    _check(args, kw)
    _check_grads(rng, args, kw)
    with jr.backend("ffi"):  # the scores: the skipped tiles keep the mask value
        scores = np.asarray(jax.jit(functools.partial(jr.attention_scores, **kw))(
            *(jnp.asarray(a) for a in args[:2])))
    want = ao.attention_scores(*(f64(a) for a in args[:2]), **ao.ref_kwargs(kw))
    np.testing.assert_allclose(scores, want, rtol=2e-5, atol=2e-5)


# Where one kv head's rows are not adjacent and the forward reads every key row three times or
# more, it reads a head-major copy of K and V (cpu::CopyKeyValueFirst; the native kernel test
# checks that these shapes take it, and that the copy gives the same bits). BNSD reads in place.
@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBH", "TND", "BNSD"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_head_major_key_value_copy(layout, dtype):
    rng = _rng("copy", layout, np.dtype(dtype).name)
    if layout == "TND":
        args, kw = ao.make_case(rng, "TND", dtype, N1=8, N2=2, D=64, seq_q=[400, 512],
                                seq_kv=[400, 512], sparse_mode=0)
    else:
        args, kw = ao.make_case(rng, layout, dtype, B=2, Sq=512, Skv=512, N1=8, N2=2, D=64,
                                sparse_mode=0)
    _check(args, kw)
