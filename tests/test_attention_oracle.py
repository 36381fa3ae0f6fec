"""Self-checks of the attention oracle against spec/attention.md (no jax_rope needed): the
mask table on small hand-written cases, the mode 7/8 worked examples (mask and attention
output), layouts, GQA, varlen packing, invalid rows, and the analytic gradient against finite
differences."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attention_oracle as ao

T, F = True, False
N_EXAMPLES = max(3, settings.default.max_examples // 3)


def test_mode2_left_up_causal():
    np.testing.assert_array_equal(ao.seq_mask(2, 3, 4), [[F, T, T, T], [F, F, T, T],
                                                         [F, F, F, T]])


def test_mode3_right_down_causal():
    np.testing.assert_array_equal(ao.seq_mask(3, 2, 4), [[F, F, F, T], [F, F, F, F]])
    # Sq > Skv: delta < 0, the first rows see nothing
    np.testing.assert_array_equal(ao.seq_mask(3, 3, 2), [[T, T], [F, T], [F, F]])


def test_mode4_band_bottom_right():
    # Sq == Skv: pre=1, next=0 is a width-2 causal band
    np.testing.assert_array_equal(ao.seq_mask(4, 3, 3, 1, 0), [[F, T, T], [F, F, T],
                                                               [T, F, F]])
    # Sq=2, Skv=4 (delta 2): the band hangs from the bottom-right corner
    np.testing.assert_array_equal(ao.seq_mask(4, 2, 4, 1, 0), [[T, F, F, T], [T, T, F, F]])
    # next=0 and huge pre is rightDownCausal; with Sq == Skv leftUpCausal
    np.testing.assert_array_equal(ao.seq_mask(4, 3, 5, ao.INT_MAX, 0), ao.seq_mask(3, 3, 5))
    np.testing.assert_array_equal(ao.seq_mask(4, 4, 4, ao.INT_MAX, 0), ao.seq_mask(2, 4, 4))


def test_mode0_band_and_mask():
    user = np.zeros((3, 4), bool)
    user[0, 0] = True
    assert not ao.seq_mask(0, 3, 4, 1, 0).any()  # no atten_mask: tokens are ignored
    got = ao.seq_mask(0, 3, 4, 1, 0, user=user)
    np.testing.assert_array_equal(got, [[T, T, T, T], [F, F, T, T], [T, F, F, T]])
    # negative next: the band starts left of the diagonal
    np.testing.assert_array_equal(ao.seq_mask(0, 3, 3, 2, -1, user=np.zeros((3, 3), bool)),
                                  [[T, T, T], [F, T, T], [F, F, T]])


def test_mode1_is_atten_mask():
    user = np.array([[1, 0, 1], [0, 0, 1]], np.uint8)
    np.testing.assert_array_equal(ao.seq_mask(1, 2, 3, 0, 0, user=user), user != 0)


def test_prefix_modes():
    # Sq=3, Skv=5 (delta 2), prefix 4: columns < 4 always visible, the rest rightDownCausal
    for mode in (5, 6):
        np.testing.assert_array_equal(ao.seq_mask(mode, 3, 5, prefix=4),
                                      [[F, F, F, F, T], [F, F, F, F, T], [F, F, F, F, F]])
        np.testing.assert_array_equal(ao.seq_mask(mode, 2, 2, prefix=0), ao.seq_mask(3, 2, 2))


def test_dense_mask_shapes():
    am = np.zeros((2, 3, 4, 5), bool)
    am[1, 2, 0, 0] = True
    m = ao.dense_mask(0, 4, 5, atten_mask=am)
    assert m.shape == (2, 3, 4, 5) and m.sum() == 1 and m[1, 2, 0, 0]
    assert ao.dense_mask(2, 4, 5).shape == (1, 1, 4, 5)
    assert ao.dense_mask(6, 4, 5, prefix=[1, 2, 3]).shape == (3, 1, 4, 5)
    assert ao.sparse_mask(3, 4, 5, prefix=None).shape == (1, 4, 5)
    m2 = ao.dense_mask(0, 4, 5, atten_mask=am[0, 0])
    assert m2.shape == (1, 1, 4, 5) and not m2.any()


def test_varlen_blocks_and_empty_sequence():
    # lengths q [2, 0, 1], kv [2, 0, 3]; mode 3 per sequence, cross-sequence masked
    m = ao.varlen_mask(3, [2, 2, 3], [2, 2, 5])
    exp = np.ones((3, 5), bool)
    exp[0:2, 0:2] = ao.seq_mask(3, 2, 2)
    exp[2:3, 2:5] = ao.seq_mask(3, 1, 3)
    np.testing.assert_array_equal(m, exp)
    # TND atten_mask: each sequence uses the top-left window of (maxSq, maxSkv)
    am = np.array([[0, 1, 0], [1, 0, 0]], bool)
    m1 = ao.varlen_mask(1, [2, 3], [3, 5], atten_mask=am)
    exp = np.ones((3, 5), bool)
    exp[0:2, 0:3] = am
    exp[2:3, 3:5] = am[:1, :2]
    np.testing.assert_array_equal(m1, exp)


MODE7_UNCUT = (4, 6)
MODE7_DEV1 = dict(sparse_mode=7, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9],
                  pre_tokens=6, next_tokens=-2)
MODE7_DEV2 = dict(sparse_mode=3, actual_seq_qlen=[2, 7, 11], actual_seq_kvlen=[6, 11, 15])
MODE8_UNCUT = (5, 4)
MODE8_DEV1 = dict(sparse_mode=2, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 7])
MODE8_DEV2 = dict(sparse_mode=8, actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13],
                  pre_tokens=4, next_tokens=1)


def _vm(cfg):
    c = dict(cfg)
    mode = c.pop("sparse_mode")
    return ao.sparse_mask(mode, None, None, **c)


def test_mode7_worked_example_mask():
    d1, d2 = _vm(MODE7_DEV1), _vm(MODE7_DEV2)
    assert d1.shape == (5, 9) and d2.shape == (11, 15)
    stitched = np.concatenate([d1[3:5, 3:9], d2[0:2, 0:6]])
    np.testing.assert_array_equal(stitched, ao.seq_mask(3, *MODE7_UNCUT))
    # the other sequence of device 1 keeps rightDownCausal
    np.testing.assert_array_equal(d1[0:3, 0:3], ao.seq_mask(3, 3, 3))


def test_mode8_worked_example_mask():
    d1, d2 = _vm(MODE8_DEV1), _vm(MODE8_DEV2)
    stitched = np.concatenate([d1[3:5, 3:7], d2[0:3, 0:4]])
    np.testing.assert_array_equal(stitched, ao.seq_mask(2, *MODE8_UNCUT))
    # the other sequences of device 2 are leftUpCausal
    np.testing.assert_array_equal(d2[3:8, 4:9], ao.seq_mask(2, 5, 5))
    np.testing.assert_array_equal(d2[8:12, 9:13], ao.seq_mask(2, 4, 4))


def stitch_attention(uncut, dev1, dev2, piece1, piece2, rng, n1=2, n2=1, d=8):
    """Run the uncut sequence (TND, one sequence, mode of the uncut mask) and the two device
    calls whose pieces hold its rows; returns (uncut outputs, stitched outputs), each
    (out, max, sum) with rows in order. piece = (sequence index, q row slice of the uncut)."""
    sq, skv, mode = uncut
    q = rng.standard_normal((sq, n1, d))
    k = rng.standard_normal((skv, n2, d))
    v = rng.standard_normal((skv, n2, d))
    full = ao.flash_attention_score(q, k, v, input_layout="TND", sparse_mode=mode,
                                    actual_seq_qlen=[sq], actual_seq_kvlen=[skv])
    parts = []
    for cfg, (seq, rows) in ((dev1, piece1), (dev2, piece2)):
        args = device_inputs(cfg, seq, q[rows], k, v, rng)
        parts.append((ao.flash_attention_score(*args, input_layout="TND", **cfg), cfg, seq))
    stitched = []
    for j in range(3):
        chunks = []
        for res, cfg, seq in parts:
            cq = [0] + list(cfg["actual_seq_qlen"])
            chunks.append(res[j][cq[seq]:cq[seq + 1]])
        stitched.append(np.concatenate(chunks))
    return full, stitched


def device_inputs(cfg, seq, q_piece, k, v, rng):
    """Packed (q, k, v) of one device: sequence ``seq`` holds the piece, the others are random
    filler of their lengths."""
    lq, lkv = ao.seq_lens(cfg["actual_seq_qlen"]), ao.seq_lens(cfg["actual_seq_kvlen"])
    n1, d = q_piece.shape[1:]
    n2 = k.shape[1]
    qs, ks, vs = [], [], []
    for b in range(len(lq)):
        if b == seq:
            assert (lq[b], lkv[b]) == (q_piece.shape[0], k.shape[0])
            qs.append(q_piece), ks.append(k), vs.append(v)
        else:
            qs.append(rng.standard_normal((lq[b], n1, d)))
            ks.append(rng.standard_normal((lkv[b], n2, d)))
            vs.append(rng.standard_normal((lkv[b], n2, v.shape[-1])))
    return np.concatenate(qs), np.concatenate(ks), np.concatenate(vs)


def test_mode7_worked_example_attention():
    rng = np.random.default_rng(7)
    full, st_ = stitch_attention((4, 6, 3), MODE7_DEV1, MODE7_DEV2, (1, slice(0, 2)),
                                 (0, slice(2, 4)), rng)
    for a, b in zip(st_, full):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_mode8_worked_example_attention():
    rng = np.random.default_rng(8)
    full, st_ = stitch_attention((5, 4, 2), MODE8_DEV1, MODE8_DEV2, (1, slice(0, 2)),
                                 (0, slice(2, 5)), rng)
    for a, b in zip(st_, full):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_invalid_rows():
    rng = np.random.default_rng(0)
    # Sq=3 > Skv=2 rightDownCausal: row 0 sees nothing
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=3, Skv=2, N1=2, D=4, sparse_mode=3)
    out, mx, sm = ao.flash_attention_score(*args, **kw)
    assert np.all(out[:, 0] == 0)
    assert np.all(mx[:, :, 0] == ao.FLOAT32_LOWEST) and np.all(sm[:, :, 0] == ao.FLOAT32_MAX)
    assert np.all(np.isfinite(out)) and np.all(mx[:, :, 1:] > -10) and np.all(sm[:, :, 1:] >= 1)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = ao.flash_attention_grad(*args, dout, **kw)
    assert np.all(dq[:, 0] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    s = ao.attention_scores(*args[:2], **kw)
    assert np.all(s[:, :, 0] == ao.FLOAT32_LOWEST)


def test_stats_reproduce_softmax():
    rng = np.random.default_rng(1)
    args, kw = ao.make_case(rng, "BNSD", B=2, Sq=5, Skv=7, N1=4, N2=2, D=8, Dv=4,
                            sparse_mode=4, pre_tokens=3, next_tokens=1)
    out, mx, sm = ao.flash_attention_score(*args, **kw)
    s = ao.attention_scores(*args[:2], **kw)
    p = np.exp(s - mx[..., None]) / sm[..., None]
    kvh = ao.kv_head_index(4, 2)
    np.testing.assert_allclose(np.einsum("bnij,bnjd->bnid", p, args[2][:, kvh]), out,
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)
    assert out.shape == (2, 4, 5, 4)


def test_layouts_agree():
    rng = np.random.default_rng(2)
    B, S, N1, N2, D, Dv = 2, 5, 4, 2, 6, 4
    q = rng.standard_normal((B, N1, S, D))
    k = rng.standard_normal((B, N2, S, D))
    v = rng.standard_normal((B, N2, S, Dv))
    ref = ao.flash_attention_score(q, k, v, input_layout="BNSD", sparse_mode=2)
    for layout in ("BSND", "BSH", "SBH"):
        conv = [ao.from_bnsd(x, layout) for x in (q, k, v)]
        hn = N1 if layout in ("BSH", "SBH") else None
        for x, y, n in zip(conv, (q, k, v), (N1, N2, N2)):
            np.testing.assert_array_equal(ao.to_bnsd(x, layout, n), y)
        got = ao.flash_attention_score(*conv, input_layout=layout, head_num=hn, sparse_mode=2)
        np.testing.assert_allclose(ao.to_bnsd(got[0], layout, N1), ref[0], rtol=1e-12)
        np.testing.assert_array_equal(got[1], ref[1])
        np.testing.assert_array_equal(got[2], ref[2])
    # TND with equal lengths is the batch packed along tokens
    tq = [ao.from_bnsd(x[b:b + 1], "TND") for x in (q, k, v) for b in range(B)]
    packed = [np.concatenate(tq[i * B:(i + 1) * B]) for i in range(3)]
    got = ao.flash_attention_score(*packed, input_layout="TND", sparse_mode=2,
                                   actual_seq_qlen=[S, 2 * S], actual_seq_kvlen=[S, 2 * S])
    np.testing.assert_allclose(got[0], np.concatenate([ao.from_bnsd(ref[0][b:b + 1], "TND")
                                                       for b in range(B)]), rtol=1e-12)
    np.testing.assert_allclose(got[1], np.concatenate([ref[1][b].T for b in range(B)]))


def test_gqa_is_repeated_heads():
    rng = np.random.default_rng(3)
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=3, Skv=4, N1=6, N2=2, D=4, sparse_mode=3)
    q, k, v = args
    rep = [np.repeat(x, 3, axis=2) for x in (k, v)]
    a = ao.flash_attention_score(q, k, v, **kw)
    b = ao.flash_attention_score(q, *rep, **kw)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12)
    # query head 4 uses kv head 4 // 3 == 1
    assert list(ao.kv_head_index(6, 2)) == [0, 0, 0, 1, 1, 1]


def test_compressed_masks():
    m = ao.compressed_mask(2)
    assert m.shape == (2048, 2048) and m[0, 1] and not m[1, 1] and not m[5, 0]
    m6 = ao.compressed_mask(6)
    assert m6.shape == (3072, 2048)
    assert not m6[2048:, :1024].any() and m6[2048:, 1024:].all()
    np.testing.assert_array_equal(m6[:2048], m)


def test_band_rule_examples():
    assert ao.band_valid(2, 0, 4, 4)
    assert not ao.band_valid(-1, -1, 4, 4)
    assert ao.band_valid(-1, 2, 4, 4) and not ao.band_valid(-2, 1, 4, 4)
    assert not ao.band_valid(-4, 10, 4, 4)
    assert ao.band_valid(3, -2, 4, 4) and not ao.band_valid(1, -2, 4, 4)
    assert not ao.band_valid(10, -4, 4, 4)
    assert ao.to_top_left(4, 3, -3, 2, 6) == (-1, 1)
    assert ao.to_top_left(0, 3, -3, 2, 6) == (3, -3)


def _loss(args, kw, dout):
    return float(np.sum(ao.flash_attention_score(*args, **kw)[0] * dout))


@pytest.mark.parametrize("layout,kw", [
    ("BSND", dict(sparse_mode=0)),
    ("BNSD", dict(sparse_mode=3)),  # Sq > Skv: an invalid row
    ("BSH", dict(sparse_mode=4, pre_tokens=1, next_tokens=0)),
    ("TND", dict(sparse_mode=2)),
])
def test_gradient_finite_differences(layout, kw):
    rng = np.random.default_rng(4)
    extra = dict(seq_q=[2, 0, 3], seq_kv=[3, 0, 2]) if layout == "TND" else {}
    args, ckw = ao.make_case(rng, layout, np.float64, B=2, Sq=3, Skv=2, N1=4, N2=2, D=3,
                             Dv=2, scale=0.7, **kw, **extra)
    out = ao.flash_attention_score(*args, **ckw)[0]
    dout = rng.standard_normal(out.shape)
    grads = ao.flash_attention_grad(*args, dout, **ckw)
    eps = 1e-6
    for x, g in zip(args, grads):
        assert g.shape == x.shape
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            lp = _loss(args, ckw, dout)
            x[idx] = old - eps
            lm = _loss(args, ckw, dout)
            x[idx] = old
            num[idx] = (lp - lm) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7)


@settings(max_examples=N_EXAMPLES)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=4),
       st.sampled_from([0, 2, 3, 4]), st.integers(0, 2**31 - 1))
def test_varlen_equals_per_sequence(lens, mode, seed):
    """A packed TND call equals each sequence computed alone (B=1 BSND)."""
    rng = np.random.default_rng(seed)
    lq = [a for a, _ in lens]
    lkv = [b for _, b in lens]
    tok = dict(pre_tokens=5, next_tokens=5) if mode == 4 else {}
    args, kw = ao.make_case(rng, "TND", B=None, N1=2, N2=1, D=4, seq_q=lq, seq_kv=lkv,
                            sparse_mode=mode, **tok)
    out, mx, sm = ao.flash_attention_score(*args, **kw)
    q0 = k0 = 0
    for a, b in zip(lq, lkv):
        if a and b:
            one = [x[None] for x in (args[0][q0:q0 + a], args[1][k0:k0 + b],
                                     args[2][k0:k0 + b])]
            ref = ao.flash_attention_score(*one, sparse_mode=mode, **tok)
            np.testing.assert_allclose(out[q0:q0 + a], ref[0][0], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(mx[q0:q0 + a], ref[1][0].T, rtol=1e-12)
        elif a:
            assert np.all(out[q0:q0 + a] == 0) and np.all(mx[q0:q0 + a] == ao.FLOAT32_LOWEST)
        q0 += a
        k0 += b
