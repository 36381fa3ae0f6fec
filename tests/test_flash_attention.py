"""Forward of jr.flash_attention_score (out, softmax_max, softmax_sum) against the NumPy oracle
(spec/attention.md): every sparse mode, Sq != Skv, negative tokens, prefix, varlen with empty
sequences, the mode 7/8 worked examples stitched back, GQA, every layout and dtype, Dv < D,
fully masked rows, traced varlen lengths under jit, agreement with
jax.nn.dot_product_attention, and sizes spanning several tiles (also drawn at random, with
the split decode's short query blocks, in every dtype, mode and layout)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attention_oracle as ao
import jax_rope as jr
from attention_oracle import f64

N_EXAMPLES = max(3, settings.default.max_examples // 3)
# The tile-crossing property (test_property_across_tiles and its gradient twin): more
# examples, since each reaches only some of the kernels' paths.
TILE_EXAMPLES = max(3, settings.default.max_examples // 2)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# (rtol, atol) against the float64 oracle on the (upcast) inputs
TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1e-2)}


def rng_for(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def call(args, kw, jit=False):
    f = functools.partial(jr.flash_attention_score, **kw)
    if jit:
        f = jax.jit(f)
    return [np.asarray(o) for o in f(*(jnp.asarray(a) for a in args))]


def stats_bns(stat, layout):
    """Statistics as (B, N1, Sq) ((Tq, N1) for TND becomes (1, N1, Tq))."""
    return stat.T[None] if layout == "TND" else stat


def check_forward(got, args, kw, err=""):
    """out / softmax_max / softmax_sum against the oracle, with exact invalid-row values."""
    layout = kw.get("input_layout", "BSND")
    dt = np.dtype(args[0].dtype)
    out, mx, sm = got
    ref = ao.flash_attention_score(*(f64(a) for a in args), **kw)
    assert out.dtype == dt, (out.dtype, dt, err)
    assert out.shape == ref[0].shape, (out.shape, ref[0].shape, err)
    for name, g, r in (("softmax_max", mx, ref[1]), ("softmax_sum", sm, ref[2])):
        assert g.dtype == np.float32, (name, g.dtype, err)
        assert g.shape == r.shape, (name, g.shape, r.shape, err)
    for name, g in zip(("out", "softmax_max", "softmax_sum"), got):
        assert not np.isnan(f64(g)).any(), f"{err}: NaN in {name}"
    rtol, atol = TOL[dt.name]
    invalid = stats_bns(ref[1], layout) == ao.FLOAT32_LOWEST
    if invalid.any():
        n1 = invalid.shape[1]
        o4 = ao.to_bnsd(out, layout, n1)
        assert np.all(o4[invalid] == 0), f"{err}: fully masked rows must give out 0"
        np.testing.assert_array_equal(stats_bns(mx, layout)[invalid], ao.FLOAT32_LOWEST,
                                      err_msg=f"{err}: softmax_max of fully masked rows")
        np.testing.assert_array_equal(stats_bns(sm, layout)[invalid], ao.FLOAT32_MAX,
                                      err_msg=f"{err}: softmax_sum of fully masked rows")
    valid = ~invalid
    np.testing.assert_allclose(f64(out), ref[0], rtol=rtol, atol=atol, err_msg=f"{err}: out")
    np.testing.assert_allclose(stats_bns(mx, layout)[valid], stats_bns(ref[1], layout)[valid],
                               rtol=rtol, atol=atol, err_msg=f"{err}: softmax_max")
    np.testing.assert_allclose(stats_bns(sm, layout)[valid], stats_bns(ref[2], layout)[valid],
                               rtol=rtol, atol=atol, err_msg=f"{err}: softmax_sum")
    return ref


def run_case(args, kw, jit=False, err=""):
    return check_forward(call(args, kw, jit), args, kw, err or repr(kw))


# sparse modes -----------------------------------------------------------------------------

@pytest.mark.parametrize("sq,skv", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5, 6])
def test_sparse_modes(backend, mode, sq, skv):
    """Every non-varlen mode, Sq == Skv and both Sq != Skv, GQA (4 query heads on 2)."""
    rng = rng_for("modes", mode, sq, skv)
    B, N1 = 2, 4
    args, kw = ao.make_case(rng, "BSND", B=B, Sq=sq, Skv=skv, N1=N1, N2=2, D=16,
                            **ao.mode_kwargs(mode, rng, B, sq, skv, N1))
    run_case(args, kw)


@pytest.mark.parametrize("pre,nxt", [(2, -1), (-1, 2), (3, -2), (0, 0)])
@pytest.mark.parametrize("mode", [0, 4])
def test_negative_tokens(backend, mode, pre, nxt):
    """Negative pre/next: a band off the diagonal (the rows it misses are invalid rows)."""
    rng = rng_for("neg", mode, pre, nxt)
    extra = {"atten_mask": np.zeros((6, 6), bool)} if mode == 0 else {}
    args, kw = ao.make_case(rng, "BNSD", B=1, Sq=6, N1=2, N2=1, D=8, sparse_mode=mode,
                            pre_tokens=pre, next_tokens=nxt, **extra)
    run_case(args, kw)


@pytest.mark.parametrize("sq,skv", [(3, 7), (7, 3)])
@pytest.mark.parametrize("mode", [0, 4])
def test_default_tokens(backend, mode, sq, skv):
    """The default pre/next 2147483647 with Sq != Skv (the mode 4 conversion and i + next
    go past int32 range): the band then masks nothing."""
    rng = rng_for("default-tok", mode, sq, skv)
    extra = {"atten_mask": ao.random_atten_mask(rng, (sq, skv), 0.2)} if mode == 0 else {}
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=sq, Skv=skv, N1=2, D=8, sparse_mode=mode,
                            **extra)
    run_case(args, kw)
    if mode == 4:  # one side given, the other default
        run_case(args, dict(kw, pre_tokens=1))
        run_case(args, dict(kw, next_tokens=0))


def test_negative_tokens_bottom_right(backend):
    """Mode 4 with Sq=3, Skv=7: pre=3 becomes pre'=-1 after conversion to top-left."""
    rng = rng_for("neg-br")
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=3, Skv=7, N1=2, D=8, sparse_mode=4,
                            pre_tokens=3, next_tokens=-2)
    run_case(args, kw)


@pytest.mark.parametrize("sq,skv,mask_dtype", [(4, 6, bool), (6, 4, np.uint8)])
@pytest.mark.parametrize("mode", [5, 6])
def test_prefix(backend, mode, sq, skv, mask_dtype):
    rng = rng_for("prefix", mode, sq, skv, mask_dtype)
    B = 3
    args, kw = ao.make_case(rng, "BNSD", B=B, Sq=sq, Skv=skv, N1=2, D=8,
                            **ao.mode_kwargs(mode, rng, B, sq, skv, 2, mask_dtype))
    kw["prefix"] = [max(skv - sq, 0), skv, (skv + max(skv - sq, 0)) // 2]
    if mode == 5:
        kw["atten_mask"] = ao.dense_mask(6, sq, skv, prefix=kw["prefix"]).astype(mask_dtype)
    run_case(args, kw)


@pytest.mark.parametrize("shape,mask_dtype", [("SqSkv", bool), ("11", np.uint8), ("B1", bool),
                                              ("BN", np.uint8)])
@pytest.mark.parametrize("mode", [0, 1])
def test_atten_mask_shapes(backend, mode, shape, mask_dtype):
    rng = rng_for("amask", mode, shape, mask_dtype)
    B, N1, sq, skv = 2, 4, 5, 6
    mshape = {"SqSkv": (sq, skv), "11": (1, 1, sq, skv), "B1": (B, 1, sq, skv),
              "BN": (B, N1, sq, skv)}[shape]
    am = ao.random_atten_mask(rng, mshape, 0.3, mask_dtype)
    am.reshape(-1, skv)[0] = 1  # one fully masked row
    tok = dict(pre_tokens=3, next_tokens=1) if mode == 0 else {}
    args, kw = ao.make_case(rng, "BSND", B=B, Sq=sq, Skv=skv, N1=N1, N2=2, D=8,
                            sparse_mode=mode, atten_mask=am, **tok)
    run_case(args, kw)


@pytest.mark.parametrize("mode", [2, 6])
def test_compressed_mask_accepted(backend, mode):
    """Modes 2..8 take the geometry from the mode: the compressed mask changes nothing."""
    rng = rng_for("compressed", mode)
    extra = {"prefix": [3, 5]} if mode == 6 else {}
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=4, Skv=6, N1=2, D=8, sparse_mode=mode,
                            **extra)
    ref = run_case(args, kw)
    got = call(args, dict(kw, atten_mask=ao.compressed_mask(mode)))
    check_forward(got, args, kw)
    np.testing.assert_allclose(got[0], ref[0], rtol=2e-5, atol=2e-5)


def test_scale(backend):
    rng = rng_for("scale")
    for scale in (0.3, 1.0):
        args, kw = ao.make_case(rng, "BSND", B=1, Sq=4, Skv=5, N1=2, D=8, sparse_mode=3,
                                scale=scale)
        run_case(args, kw)


# layouts, dtypes, GQA, Dv ------------------------------------------------------------------

def layout_case(rng, layout, dtype, mode=3, Dv=8):
    """GQA 4 on 2, D=16, Dv=8, Sq=5 != Skv=6 (TND: lengths with an empty sequence)."""
    dt = DTYPES[dtype]
    if layout == "TND":
        lq, lkv = [3, 0, 4, 2], [4, 0, 5, 2]
        return ao.make_case(rng, layout, dt, N1=4, N2=2, D=16, Dv=Dv, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    return ao.make_case(rng, layout, dt, B=2, Sq=5, Skv=6, N1=4, N2=2, D=16, Dv=Dv,
                        **ao.mode_kwargs(mode, rng, 2, 5, 6, 4))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ao.LAYOUTS)
def test_layout_dtype(backend, layout, dtype):
    args, kw = layout_case(rng_for("layout", layout, dtype), layout, dtype)
    run_case(args, kw)


@pytest.mark.parametrize("layout", ao.LAYOUTS)
def test_layouts_agree(backend, layout):
    """The same attention in every layout (converted from BNSD) gives the same numbers."""
    rng = rng_for("agree")
    B, sq, skv, N1, N2, D, Dv = 2, 4, 5, 4, 2, 8, 4
    q = rng.standard_normal((B, N1, sq, D)).astype(np.float32)
    k = rng.standard_normal((B, N2, skv, D)).astype(np.float32)
    v = rng.standard_normal((B, N2, skv, Dv)).astype(np.float32)
    base = call([q, k, v], dict(input_layout="BNSD", sparse_mode=3))
    if layout == "TND":
        conv = [np.concatenate([ao.from_bnsd(x[b:b + 1], "TND") for b in range(B)])
                for x in (q, k, v)]
        kw = dict(input_layout="TND", sparse_mode=3, actual_seq_qlen=[sq, 2 * sq],
                  actual_seq_kvlen=[skv, 2 * skv])
        got = call(conv, kw)
        o4 = np.stack([ao.to_bnsd(got[0][b * sq:(b + 1) * sq], "TND")[0] for b in range(B)])
        mx = np.stack([got[1][b * sq:(b + 1) * sq].T for b in range(B)])
    else:
        conv = [ao.from_bnsd(x, layout) for x in (q, k, v)]
        kw = dict(input_layout=layout, sparse_mode=3)
        if layout in ("BSH", "SBH"):
            kw["head_num"] = N1
        got = call(conv, kw)
        o4, mx = ao.to_bnsd(got[0], layout, N1), got[1]
    np.testing.assert_allclose(o4, base[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(mx, base[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("n1,n2", [(1, 1), (3, 1), (4, 2), (6, 3), (2, 2)])
def test_gqa(backend, n1, n2):
    rng = rng_for("gqa", n1, n2)
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=4, Skv=5, N1=n1, N2=n2, D=8, sparse_mode=2)
    run_case(args, kw)


@pytest.mark.parametrize("layout", ao.LAYOUTS)
def test_dv_smaller_than_d(backend, layout):
    args, kw = layout_case(rng_for("dv", layout), layout, "float32", mode=2, Dv=4)
    ref = run_case(args, kw)
    assert ref[0].shape[-1] == (4 * 4 if layout in ("BSH", "SBH") else 4)


# varlen ------------------------------------------------------------------------------------

VARLEN_LENS = ([2, 0, 3, 4], [3, 0, 4, 4])


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 6, 7, 8])
def test_varlen_modes(backend, mode):
    """TND with an empty sequence in every mode allowed there."""
    rng = rng_for("varlen", mode)
    lq, lkv = VARLEN_LENS
    args, kw = ao.make_case(rng, "TND", N1=4, N2=2, D=8, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    run_case(args, kw)


def test_varlen_unequal_lengths_and_empty_kv(backend):
    """Sequences with Sq_b > Skv_b (rightDownCausal invalid rows) and a query-only sequence."""
    rng = rng_for("varlen-odd")
    for mode in (0, 3):
        args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=[4, 2, 1],
                                seq_kv=[2, 0, 3], sparse_mode=mode)
        ref = run_case(args, kw)
        assert np.all(ref[1][4:6] == ao.FLOAT32_LOWEST)


def test_mode8_band_on_a_sequence_without_keys(backend):
    """Mode 8's band sequence is the first with query rows, keys or not (the operator's
    tiling: the first nonzero actualSeqQLen entry): here the key-less sequence 0 carries
    the band, so sequence 1 is plain leftUpCausal, not a band of next_tokens=2."""
    rng = rng_for("mode8-keyless")
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=[2, 3], seq_kv=[0, 4],
                            sparse_mode=8, pre_tokens=4, next_tokens=2)
    ref = run_case(args, kw)
    visible = ao.visible_mask(*(f64(a) for a in args[:2]), **kw)
    assert not visible[..., 2, 1:].any() and not visible[..., :2, :].any()  # j > i: masked
    assert np.all(ref[1][:2] == ao.FLOAT32_LOWEST)


@pytest.mark.parametrize("mode", [0, 4])
def test_varlen_negative_tokens(backend, mode):
    """Negative next_tokens per sequence (mode 4: each sequence's own bottom-right origin)."""
    rng = rng_for("varlen-neg", mode)
    lq, lkv = [4, 0, 3], [4, 0, 6]
    extra = {"atten_mask": np.zeros((4, 6), bool)} if mode == 0 else {}
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                            sparse_mode=mode, pre_tokens=2 if mode == 0 else 1,
                            next_tokens=-1, **extra)
    for a, b in zip(lq, lkv):
        if a:
            assert ao.band_valid(*ao.to_top_left(mode, kw["pre_tokens"], -1, a, b), a, b)
    run_case(args, kw)


def test_varlen_length_containers(backend):
    """actual_seq_* as lists, tuples and NumPy arrays give the same result."""
    rng = rng_for("containers")
    args, kw = ao.make_case(rng, "TND", N1=2, D=8, seq_q=[2, 3], seq_kv=[4, 1], sparse_mode=3)
    base = call(args, kw)
    for conv in (tuple, lambda x: np.asarray(x, np.int32), lambda x: np.asarray(x, np.int64)):
        got = call(args, dict(kw, actual_seq_qlen=conv(kw["actual_seq_qlen"]),
                              actual_seq_kvlen=conv(kw["actual_seq_kvlen"])))
        np.testing.assert_array_equal(got[0], base[0])
    check_forward(base, args, kw)


MODE7 = dict(uncut=(4, 6, 3),
             dev1=(dict(sparse_mode=7, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9],
                        pre_tokens=6, next_tokens=-2), 1, slice(0, 2)),
             dev2=(dict(sparse_mode=3, actual_seq_qlen=[2, 7, 11],
                        actual_seq_kvlen=[6, 11, 15]), 0, slice(2, 4)))
MODE8 = dict(uncut=(5, 4, 2),
             dev1=(dict(sparse_mode=2, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 7]), 1,
                   slice(0, 2)),
             dev2=(dict(sparse_mode=8, actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13],
                        pre_tokens=4, next_tokens=1), 0, slice(2, 5)))


def device_inputs(cfg, seq, q_piece, k, v, rng):
    """Packed (q, k, v) of one device: sequence ``seq`` holds the piece, others random."""
    lq, lkv = ao.seq_lens(cfg["actual_seq_qlen"]), ao.seq_lens(cfg["actual_seq_kvlen"])
    n1, d = q_piece.shape[1:]
    qs, ks, vs = [], [], []
    for b in range(len(lq)):
        if b == seq:
            qs.append(q_piece), ks.append(k), vs.append(v)
        else:
            qs.append(rng.standard_normal((lq[b], n1, d)).astype(np.float32))
            ks.append(rng.standard_normal((lkv[b],) + k.shape[1:]).astype(np.float32))
            vs.append(rng.standard_normal((lkv[b],) + v.shape[1:]).astype(np.float32))
    return [np.concatenate(x) for x in (qs, ks, vs)]


@pytest.mark.parametrize("example", ["mode7", "mode8"])
def test_worked_example_stitch(backend, example):
    """The per-device outputs of the cut sequence stitch back to the uncut attention."""
    ex = MODE7 if example == "mode7" else MODE8
    rng = rng_for("stitch", example)
    sq, skv, mode = ex["uncut"]
    q = rng.standard_normal((sq, 4, 8)).astype(np.float32)
    k = rng.standard_normal((skv, 2, 8)).astype(np.float32)
    v = rng.standard_normal((skv, 2, 8)).astype(np.float32)
    full = call([q[None], k[None], v[None]], dict(sparse_mode=mode))  # BSND, B=1
    check_forward(full, [q[None], k[None], v[None]], dict(sparse_mode=mode))
    pieces = []
    for cfg, seq, rows in (ex["dev1"], ex["dev2"]):
        args = device_inputs(cfg, seq, q[rows], k, v, rng)
        kw = dict(cfg, input_layout="TND")
        got = call(args, kw)
        check_forward(got, args, kw, example)
        c0 = ([0] + list(cfg["actual_seq_qlen"]))[seq]
        n = rows.stop - rows.start
        pieces.append([got[0][c0:c0 + n], got[1][c0:c0 + n], got[2][c0:c0 + n]])
    out = np.concatenate([p[0] for p in pieces])
    mx = np.concatenate([p[1] for p in pieces])
    sm = np.concatenate([p[2] for p in pieces])
    np.testing.assert_allclose(out, full[0][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(mx, full[1][0].T, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(sm, full[2][0].T, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mode", [0, 2, 3])
def test_traced_varlen_no_retrace(backend, mode):
    """Traced int32 cumulative lengths under jit: one trace for different lengths."""
    traces = [0]

    @jax.jit
    def f(q, k, v, cq, ckv):
        traces[0] += 1
        return jr.flash_attention_score(q, k, v, input_layout="TND", sparse_mode=mode,
                                        actual_seq_qlen=cq, actual_seq_kvlen=ckv)

    rng = rng_for("traced", mode)
    for lq, lkv in (([2, 3, 1], [3, 1, 2]), ([1, 0, 5], [2, 0, 4]), ([6, 0, 0], [6, 0, 0])):
        args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                                sparse_mode=mode)
        got = f(*(jnp.asarray(a) for a in args),
                jnp.asarray(kw["actual_seq_qlen"], jnp.int32),
                jnp.asarray(kw["actual_seq_kvlen"], jnp.int32))
        check_forward([np.asarray(g) for g in got], args, kw, f"traced {lq} {lkv}")
    assert traces[0] == 1, f"retraced {traces[0]} times for new lengths"


# fully masked rows ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fully_masked_rows(backend, dtype):
    dt = DTYPES[dtype]
    rng = rng_for("invalid", dtype)
    # rightDownCausal with Sq > Skv: the first Sq - Skv rows see nothing
    args, kw = ao.make_case(rng, "BSND", dt, B=1, Sq=6, Skv=3, N1=2, D=8, sparse_mode=3)
    ref = run_case(args, kw)
    assert (ref[1] == ao.FLOAT32_LOWEST).sum() == 2 * 3
    # every position masked
    args, kw = ao.make_case(rng, "BSND", dt, B=1, Sq=3, Skv=4, N1=2, D=8, sparse_mode=1,
                            atten_mask=np.ones((3, 4), bool))
    out, mx, sm = call(args, kw)
    assert np.all(f64(out) == 0)
    assert np.all(mx == ao.FLOAT32_LOWEST) and np.all(sm == ao.FLOAT32_MAX)


# peers ----------------------------------------------------------------------------------------

def test_peer_causal(backend):
    """sparse_mode 2 equals jax.nn.dot_product_attention(is_causal=True)."""
    rng = rng_for("peer-causal")
    args, _ = ao.make_case(rng, "BSND", B=2, Sq=9, N1=4, N2=2, D=16)
    q, k, v = (jnp.asarray(a) for a in args)
    got = jr.flash_attention_score(q, k, v, sparse_mode=2)[0]
    exp = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pre,nxt", [(3, 1), (0, 2), (4, 0)])
def test_peer_local_window(backend, pre, nxt):
    """sparse_mode 4 (Sq == Skv) equals dot_product_attention(local_window_size=(pre, next))."""
    rng = rng_for("peer-band", pre, nxt)
    args, _ = ao.make_case(rng, "BSND", B=2, Sq=10, N1=2, N2=1, D=8)
    q, k, v = (jnp.asarray(a) for a in args)
    got = jr.flash_attention_score(q, k, v, sparse_mode=4, pre_tokens=pre, next_tokens=nxt)[0]
    exp = jax.nn.dot_product_attention(q, k, v, local_window_size=(pre, nxt))
    np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=2e-5, atol=2e-5)


# sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("sq,skv,mode,tok", [
    (200, 200, 2, {}),
    (200, 200, 4, dict(pre_tokens=37, next_tokens=5)),
    (130, 200, 4, dict(pre_tokens=20, next_tokens=-3)),
    (200, 130, 3, {}),
    (200, 200, 0, dict(pre_tokens=50, next_tokens=50)),
    (150, 200, 6, {}),
], ids=["causal", "band", "band-br", "rdc-sq>skv", "mask-band", "prefix"])
def test_multi_tile(backend, sq, skv, mode, tok):
    """Sequences spanning several tiles: empty, partial and full tiles in one call."""
    rng = rng_for("tiles", sq, skv, mode)
    extra = {}
    if mode == 0:
        extra["atten_mask"] = ao.random_atten_mask(rng, (sq, skv), 0.1)
    if mode == 6:
        extra["prefix"] = [70]
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=sq, Skv=skv, N1=2, N2=1, D=32,
                            sparse_mode=mode, **tok, **extra)
    run_case(args, kw)


@pytest.mark.parametrize("mode", [0, 3, 4, 7, 8])
def test_multi_tile_varlen(backend, mode):
    """Packed sequences longer than a tile whose boundaries fall inside tiles."""
    rng = rng_for("tiles-varlen", mode)
    lq, lkv = [70, 0, 130], [90, 0, 140]
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=32, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    run_case(args, kw)


@pytest.mark.parametrize("s,d,mode", [(1, 8, 2), (1, 24, 3), (65, 24, 2), (65, 24, 3),
                                      (17, 24, 0), (17, 5, 3)])
def test_odd_sizes(backend, s, d, mode):
    rng = rng_for("odd", s, d, mode)
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=s, Skv=s + (mode == 3), N1=2, N2=1, D=d,
                            sparse_mode=mode)
    run_case(args, kw)


def test_jit_matches_eager(backend):
    rng = rng_for("jit")
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=4, Skv=5, N1=2, D=8,
                            **ao.mode_kwargs(4, rng, 2, 4, 5))
    a = call(args, kw)
    b = call(args, kw, jit=True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


# property -----------------------------------------------------------------------------------

@st.composite
def sequence_lengths(draw, longest, added):
    """(query lengths, key lengths) of one to three TND sequences, each 0..longest; where
    either side would hold no token, one more sequence of `added` of both."""
    n = draw(st.integers(1, 3))
    lq = draw(st.lists(st.integers(0, longest), min_size=n, max_size=n))
    lkv = draw(st.lists(st.integers(0, longest), min_size=n, max_size=n))
    if sum(lq) == 0 or sum(lkv) == 0:
        lq, lkv = lq + [added], lkv + [added]
    return lq, lkv


@st.composite
def forward_case(draw):
    layout = draw(st.sampled_from(ao.LAYOUTS))
    n2 = draw(st.integers(1, 2))
    n1 = n2 * draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8, 12]))
    dv = draw(st.sampled_from([d, d // 2]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if layout == "TND":
        lq, lkv = draw(sequence_lengths(longest=5, added=1))
        mode = draw(st.sampled_from([0, 1, 2, 3, 4, 6]))
        return ao.make_case(rng, layout, N1=n1, N2=n2, D=d, Dv=dv, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    b, sq, skv = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    mode = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6]))
    return ao.make_case(rng, layout, B=b, Sq=sq, Skv=skv, N1=n1, N2=n2, D=d, Dv=dv,
                        **ao.mode_kwargs(mode, rng, b, sq, skv, n1))


@settings(max_examples=N_EXAMPLES)
@given(forward_case())
def test_property(backend, case):
    args, kw = case
    run_case(args, kw)


@st.composite
def tile_case(draw):
    """((args, kw), rng) of a call across the kernels' 64 x 64 tiles: up to 260 query rows and
    keys, or a short query block (the split decode path) over up to 1100 keys (past one split
    chunk); head dims the micro-kernels block differently (and an odd one), Dv < D, GQA up to
    4, every dtype, mode and layout, TND with up to three sequences, scales other than
    1/sqrt(D) (negative too)."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    layout = draw(st.sampled_from(ao.LAYOUTS))
    n2 = draw(st.integers(1, 2))
    n1 = n2 * draw(st.integers(1, 4))
    d = draw(st.sampled_from([33, 40, 64, 72, 128, 256]))
    dv = draw(st.sampled_from([d, d // 2]))
    scale = draw(st.sampled_from([None, None, 0.5, -1.0]))  # times 1/sqrt(D)
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    op = {} if scale is None else {"scale": scale / np.sqrt(d)}
    if layout == "TND":
        lq, lkv = draw(sequence_lengths(longest=150, added=70))
        mode = draw(st.sampled_from([0, 1, 2, 3, 4, 6, 7, 8]))
        if mode == 7:  # the last sequence with query rows needs as many keys
            last = ao.band_sequence(7, lq, lkv)
            lkv[last] = max(lkv[last], lq[last])
        case = ao.make_case(rng, layout, DTYPES[dtype], N1=n1, N2=n2, D=d, Dv=dv, seq_q=lq,
                            seq_kv=lkv, **op, **ao.varlen_kwargs(mode, rng, lq, lkv))
        return case, rng
    b = draw(st.integers(1, 2))
    if draw(st.booleans()):
        sq, skv = draw(st.integers(1, 260)), draw(st.integers(1, 260))
    else:
        sq, skv = draw(st.integers(1, 8)), draw(st.integers(200, 1100))
    mode = draw(st.sampled_from(list(range(7))))
    case = ao.make_case(rng, layout, DTYPES[dtype], B=b, Sq=sq, Skv=skv, N1=n1, N2=n2, D=d,
                        Dv=dv, **op, **ao.mode_kwargs(mode, rng, b, sq, skv, n1))
    return case, rng


@settings(max_examples=TILE_EXAMPLES)
@given(tile_case())
def test_property_across_tiles(backend, case):
    (args, kw), _ = case
    run_case(args, kw, jit=True)
