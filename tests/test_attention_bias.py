"""Positional bias (pse, ALiBi) of jr.flash_attention_score and jr.attention_scores against the
float64 oracle (spec/attention_bias_dropout.md sections 2, 4, 5, 7): every pse form of 2.1 x
pse_type x layout x a representative set of sparse modes, forward, scores and gradients incl.
dpse; the TND packed and compressed forms, start offsets and the mode-8 rule; multi-tile sizes;
the worked examples; outside references (jax.nn.dot_product_attention with a pre-scaled bias,
flash-attn's bottom-right ALiBi formula); fully masked rows, NaN/Inf at masked positions,
jit/vmap/traced offsets, low precision. The section 5 validation rules for pse:
test_attention_bias_validation.py."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import attention_oracle as ao
import bias_dropout_oracle as bo
import jax_rope as jr
from attention_oracle import f64

LOWEST = np.float32(ao.FLOAT32_LOWEST)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TOL = {"float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3), "bfloat16": (2e-2, 2e-2)}
GTOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (4e-2, 4e-2)}
DROP_KW = ("keep_prob", "dropout_key", "dropout_mask")
EXTRA_KW = DROP_KW + ("pse_type", "q_start_idx", "kv_start_idx")


def visible(args, kw):
    """(B, N1, Sq, Skv) bool of visible positions (attention_oracle; TND (1, N1, Tq, Tkv))."""
    return ao.visible_mask(*(f64(a) for a in args[:2]),
                           **{k: v for k, v in kw.items() if k not in EXTRA_KW})


def on_backends(cases, fallback_too):
    """(backend, *case) parameters: every case on "ffi", the cases whose index is in
    ``fallback_too`` also on "fallback" (the dense jnp fallback has no tiles; the subset still
    covers every pse type, form, layout and the modes, and keeps the files' runtime lean).
    Use with indirect=["backend"] so conftest's fixture sets the backend."""
    out = []
    for i, case in enumerate(cases):
        for b in ("ffi", "fallback") if i in fallback_too else ("ffi",):
            name = "-".join(str(x).replace(" ", "") for x in (b, *case))
            out.append(pytest.param(b, *case, id=name))
    return out


def rng_for(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


# the oracle itself (NumPy only) -----------------------------------------------------------

@pytest.mark.parametrize("layout,pse_type,form,mode", [
    ("BSND", 1, "full", 3), ("BNSD", 0, "row", 0), ("BSND", 2, "slopes", 2),
    ("TND", 3, "slopes", 8), ("TND", 1, "packed_full", 3), ("TND", 0, "packed_row", 0),
    ("TND", 1, "compressed", 2)])
def test_oracle_gradients_finite_differences(layout, pse_type, form, mode):
    """The oracle's closed-form dq and dpse (section 4, with a keep mask) against central
    differences of its own float64 forward."""
    rng = rng_for("fd", layout, pse_type, form)
    if layout == "TND":
        args, kw, pse = tnd_case(rng, pse_type, form, False, mode, offsets=(1, 2))
    else:
        args, kw, pse = padded_case(rng, layout, pse_type, form, False, mode, B=2, Sq=3, Skv=4,
                                    N1=2, N2=1, D=4, offsets=(1, 2))
    args = [f64(a) for a in args]
    pse = f64(pse)
    geom = bo.Geometry(*args[:2], **kw)
    keep = rng.random(geom.grid) < 0.7
    kw = dict(kw, keep_prob=0.7)
    dout = rng.standard_normal(ref_run(args, kw, pse=pse, keep=keep)["out"].shape)
    ref = ref_run(args, kw, pse=pse, dout=dout, keep=keep)

    def loss(q, p):
        return float(np.sum(ref_run([q, *args[1:]], kw, pse=p, keep=keep)["out"] * dout))

    eps = 1e-6
    for name, x, g in (("dq", args[0], ref["dq"]), ("dpse", pse, ref["dpse"])):
        flat = x.reshape(-1)
        picks = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
        if name == "dpse" and form == "compressed":  # entries the expansion reads
            idx = bo.bias_index(pse.shape, form, geom)
            picks = np.unique(idx[idx >= 0])[:12]
        for e in picks:
            xp, xm = flat.copy(), flat.copy()
            xp[e] += eps
            xm[e] -= eps
            if name == "dq":
                num = (loss(xp.reshape(x.shape), pse) - loss(xm.reshape(x.shape), pse))
            else:
                num = (loss(args[0], xp.reshape(x.shape)) - loss(args[0], xm.reshape(x.shape)))
            np.testing.assert_allclose(g.reshape(-1)[e], num / (2 * eps), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}[{e}]")


def test_oracle_compressed_expansion():
    """alibi_like_compressed expands (by the 2.1 rule) to -slope * |i - j|, and a (W, W)
    ALiBi bias sliced [..., -1024:, :] is that array."""
    q = np.zeros((1, 1, 1030, 4))
    geom = bo.Geometry(q, q, input_layout="BNSD")
    pse = bo.alibi_like_compressed(np.random.default_rng(0), geom, dtype=np.float64)
    grid = bo.bias_grid(pse, 1, geom)[0, 0]
    i, j = bo.local_ij(1030, 1030)
    slope = -pse[0, 0, 1023, 1028]  # d = 1
    full = -slope * np.abs(i - j)
    near = (i - j) >= -1023
    np.testing.assert_allclose(grid[near], full[near], rtol=1e-12)
    np.testing.assert_array_equal(grid[~near], 0)
    np.testing.assert_allclose(pse[0, 0], full[-1024:], rtol=1e-12)


# the library, one jitted call: scores, forward, vjp ----------------------------------------

def lib_fn(kw, *, dout=True, scores=True, jit=True):
    """The library as one function f(q, k, v, pse, key, dmask, dout, offsets) -> dict: out,
    max, sum, (scores), and with dout dq, dk, dv, dpse. offsets: None, or (q_start_idx,
    kv_start_idx) passed as traced int32 instead of the static ones in kw."""
    kw = dict(kw)
    score_kw = {k: v for k, v in kw.items() if k not in DROP_KW}

    def f(q, k, v, pse, key, dmask, dout, offs):
        okw = {} if offs is None else {"q_start_idx": offs[0], "kv_start_idx": offs[1]}

        def fwd(q, k, v, pse):
            o, m, s = jr.flash_attention_score(q, k, v, pse=pse, dropout_key=key,
                                               dropout_mask=dmask, **kw, **okw)
            return o, (m, s)

        res = {}
        if dout is None:
            o, (m, s) = fwd(q, k, v, pse)
        else:
            o, vjp, (m, s) = jax.vjp(fwd, q, k, v, pse, has_aux=True)
            res["dq"], res["dk"], res["dv"], res["dpse"] = vjp(dout.astype(o.dtype))
        res.update(out=o, max=m, sum=s)
        if scores:
            res["scores"] = jr.attention_scores(q, k, pse=pse, **score_kw, **okw)
        return res

    return jax.jit(f) if jit else f


def lib_run(args, kw, *, pse=None, dout=None, dropout_key=None, dropout_mask=None,
            scores=True, jit=True, offsets=None, fn=None):
    """Runs the library (``fn`` from lib_fn, or a new one) on NumPy inputs; NumPy results."""
    fn = fn or lib_fn(kw, scores=scores, jit=jit)
    conv = (lambda a: None if a is None else jnp.asarray(a))
    offs = None if offsets is None else tuple(jnp.int32(o) for o in offsets)
    res = fn(*(jnp.asarray(a) for a in args), conv(pse), dropout_key, conv(dropout_mask),
             None if dout is None else jnp.asarray(dout, jnp.float32), offs)
    return {k: (None if v is None else np.asarray(v)) for k, v in res.items()}


def ref_run(args, kw, *, pse=None, dout=None, keep=None):
    okw = {k: v for k, v in kw.items() if k not in DROP_KW}
    return bo.run(*(f64(a) for a in args), None if dout is None else f64(dout),
                  pse=None if pse is None else f64(pse), keep=keep,
                  keep_prob=kw.get("keep_prob", 1.0), **okw)


def stats_bns(stat, layout):
    return stat.T[None] if layout == "TND" else stat


def assert_close(got, exp, tol, what):
    rtol, atol = tol
    exp = f64(exp)
    assert got.shape == exp.shape, (what, got.shape, exp.shape)
    assert not np.isnan(f64(got)).any(), f"{what}: NaN"
    scale = max(1.0, float(np.max(np.abs(exp)))) if exp.size else 1.0
    np.testing.assert_allclose(f64(got), exp, rtol=rtol, atol=atol * scale, err_msg=what)


def compare(got, ref, args, kw, *, pse=None, what=""):
    """Every output of lib_run against the oracle's."""
    layout = kw.get("input_layout", "BSND")
    dt = np.dtype(args[0].dtype)
    what = what or repr({k: v for k, v in kw.items() if k != "atten_mask"})
    assert got["out"].dtype == dt, (what, got["out"].dtype)
    invalid = stats_bns(ref["max"], layout) == ao.FLOAT32_LOWEST
    if invalid.any():
        o4 = ao.to_bnsd(got["out"], layout, bo.Geometry(*args[:2], **kw).n1)
        assert np.all(f64(o4)[invalid] == 0), f"{what}: fully masked rows must give out 0"
        np.testing.assert_array_equal(stats_bns(got["max"], layout)[invalid], LOWEST, what)
        np.testing.assert_array_equal(stats_bns(got["sum"], layout)[invalid],
                                      np.float32(ao.FLOAT32_MAX), what)
    assert_close(got["out"], ref["out"], TOL[dt.name], f"{what}: out")
    for name in ("max", "sum"):
        assert got[name].dtype == np.float32
        g, r = stats_bns(got[name], layout), stats_bns(ref[name], layout)
        assert_close(g[~invalid], r[~invalid], TOL[dt.name], f"{what}: softmax_{name}")
    if "scores" in got:
        s, r = got["scores"], ref["scores"]
        assert s.dtype == np.float32 and s.shape == r.shape, (what, s.dtype, s.shape, r.shape)
        masked = r == ao.FLOAT32_LOWEST
        np.testing.assert_array_equal(s[masked], LOWEST, f"{what}: masked scores")
        assert_close(s[~masked], r[~masked], TOL[dt.name], f"{what}: scores")
    if "dq" in got:
        for name in ("dq", "dk", "dv"):
            assert got[name].dtype == dt
            assert_close(got[name], ref[name], GTOL[dt.name], f"{what}: {name}")
        if pse is None:
            assert got["dpse"] is None
        else:
            assert got["dpse"].dtype == np.dtype(pse.dtype), (what, got["dpse"].dtype)
            assert got["dpse"].shape == pse.shape
            assert_close(got["dpse"], ref["dpse"], GTOL[np.dtype(pse.dtype).name],
                         f"{what}: dpse")


def check_case(args, kw, pse, rng, *, dout=True, scores=True, what=""):
    ref0 = ref_run(args, kw, pse=pse)
    d = rng.standard_normal(ref0["out"].shape).astype(np.float32) if dout else None
    ref = ref_run(args, kw, pse=pse, dout=d)
    got = lib_run(args, kw, pse=pse, dout=d, scores=scores)
    compare(got, ref, args, kw, pse=pse, what=what)
    return got, ref


# cases -------------------------------------------------------------------------------------

FORMS = {0: [("full", False), ("row", True), ("full", True), ("row", False)],
         1: [("full", False), ("row", False), ("full", True), ("row", True)],
         2: [("slopes", False), ("slopes", True)],
         3: [("slopes", True), ("slopes", False)]}
PAD_LAYOUTS = ("BSND", "BNSD", "BSH", "SBH")
OFFSETS = [(0, 0), (2, 0), (0, 3), (-1, 4)]


def with_pse(rng, args, kw, pse_type, form, batch_one, offsets, dtype):
    """(args, kw, pse): the case's keywords with pse_type (and ALiBi offsets) and its bias."""
    kw["pse_type"] = pse_type
    if pse_type in (2, 3):
        kw["q_start_idx"], kw["kv_start_idx"] = offsets
    geom = bo.Geometry(*args[:2], **kw)
    return args, kw, bo.make_pse(rng, form, pse_type, geom, batch_one=batch_one, dtype=dtype)


def padded_case(rng, layout, pse_type, form, batch_one, mode, *, B=2, Sq=5, Skv=6, N1=4, N2=2,
                D=8, offsets=(0, 0), dtype=np.float32):
    args, kw = ao.make_case(rng, layout, dtype, B=B, Sq=Sq, Skv=Skv, N1=N1, N2=N2, D=D,
                            **ao.mode_kwargs(mode, rng, B, Sq, Skv, N1))
    return with_pse(rng, args, kw, pse_type, form, batch_one, offsets, dtype)


def padded_params():
    """Types 0/1 in every layout with their four forms, types 2/3 with both slope shapes in
    two or three layouts each; modes 0..6 each at least once with a tensor bias, and with
    slopes 0, 1, 3, 4, 5, 6 (mode 2 with slopes: TND and test_multi_tile)."""
    modes = (0, 3, 4, 2, 1, 5, 6)
    out = []
    for t in (1, 0):
        for li, layout in enumerate(PAD_LAYOUTS):
            form, one = FORMS[t][li]
            out.append((layout, t, form, one, modes[(li + 4 * t) % 7], OFFSETS[0]))
    for k, (t, layout) in enumerate(((2, "BSND"), (2, "SBH"), (3, "BNSD"), (3, "BSH"))):
        form, one = FORMS[t][k % 2]
        out.append((layout, t, form, one, (0, 4, 6, 3)[k], OFFSETS[k]))
    out.append(("BSH", 2, "slopes", True, 5, OFFSETS[3]))
    out.append(("BNSD", 3, "slopes", False, 1, OFFSETS[2]))
    return out


@pytest.mark.parametrize("backend,layout,pse_type,form,batch_one,mode,offsets",
                         on_backends(padded_params(), {0, 1, 3, 6, 8, 10}), indirect=["backend"])
def test_padded_layouts(backend, layout, pse_type, form, batch_one, mode, offsets):
    """Non-TND: forward, scores, dq/dk/dv/dpse vs the oracle (GQA 4 on 2, Sq=5 != Skv=6)."""
    rng = rng_for("padded", layout, pse_type, form, batch_one, mode)
    args, kw, pse = padded_case(rng, layout, pse_type, form, batch_one, mode, offsets=offsets)
    check_case(args, kw, pse, rng)


TND_Q, TND_KV = [3, 0, 4, 2], [4, 0, 5, 2]
TND_FORMS = {0: [("packed_full", False), ("packed_row", False), ("compressed", True),
                 ("compressed", False)],
             1: [("packed_row", False), ("compressed", False), ("packed_full", False),
                 ("compressed", True)],
             2: FORMS[2], 3: FORMS[3]}
TND_MODES = (0, 2, 3, 4, 8)


def tnd_params():
    """Every TND form of every type; modes 0, 2, 3, 4, 8 each at least once with a tensor
    bias and with slopes."""
    return [(1, "packed_row", False, 0, OFFSETS[0]), (1, "compressed", False, 2, OFFSETS[0]),
            (1, "packed_full", False, 8, OFFSETS[0]), (0, "packed_full", False, 4, OFFSETS[0]),
            (0, "compressed", True, 3, OFFSETS[0]), (0, "packed_row", False, 8, OFFSETS[0]),
            (2, "slopes", False, 0, OFFSETS[1]), (2, "slopes", True, 3, OFFSETS[2]),
            (3, "slopes", True, 8, OFFSETS[3]), (3, "slopes", False, 4, OFFSETS[3]),
            (3, "slopes", False, 2, OFFSETS[1])]


def tnd_case(rng, pse_type, form, batch_one, mode, offsets=(0, 0), lq=None, lkv=None, N1=4,
             N2=2, D=8, dtype=np.float32):
    if lq is None:
        lq, lkv = (TND_Q, TND_Q) if form == "compressed" else (TND_Q, TND_KV)
    args, kw = ao.make_case(rng, "TND", dtype, N1=N1, N2=N2, D=D, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    return with_pse(rng, args, kw, pse_type, form, batch_one, offsets, dtype)


@pytest.mark.parametrize("backend,pse_type,form,batch_one,mode,offsets",
                         on_backends(tnd_params(), {0, 1, 3, 4, 6, 8}), indirect=["backend"])
def test_tnd(backend, pse_type, form, batch_one, mode, offsets):
    """TND (with an empty sequence, Sq_b != Skv_b except for the compressed form): packed
    full/row, compressed (B or 1), slopes (N1,)/(B, N1) with offsets, modes 0, 2, 3, 4, 8."""
    rng = rng_for("tnd", pse_type, form, batch_one, mode)
    args, kw, pse = tnd_case(rng, pse_type, form, batch_one, mode, offsets)
    check_case(args, kw, pse, rng)


@pytest.mark.parametrize("case", ["bnsd-alibi-2", "tnd-packed-3", "tnd-sqrt-8"])
def test_multi_tile(backend, case):
    """Sizes that cross the kernels' tiles (64): 130..257 rows and columns (a full tensor bias
    across tiles: test_attention_dropout.py's "tiles" case; the compressed form: 1030)."""
    rng = rng_for("tiles", case)
    if case == "bnsd-alibi-2":
        args, kw, pse = padded_case(rng, "BNSD", 2, "slopes", False, 2, B=1, Sq=257, Skv=257,
                                    N1=2, N2=2, D=8, offsets=(5, 2))
        pse = pse * 0.05  # keep exp(-slope * 257) meaningful
    elif case == "tnd-packed-3":
        args, kw, pse = tnd_case(rng, 0, "packed_full", False, 3, lq=[70, 150],
                                 lkv=[100, 150], N1=2, N2=1)
    else:  # mode 8, cut piece Sq_0 + q_start == Skv_0 (NPU-coverable)
        args, kw, pse = tnd_case(rng, 3, "slopes", True, 8, offsets=(70, 0), lq=[60, 140],
                                 lkv=[130, 140], N1=2, N2=2)
    check_case(args, kw, pse, rng)


@pytest.mark.parametrize("backend,mode,pse_type,kind",
                         on_backends([(0, 1, "random"), (3, 0, "alibi")], {0}),
                         indirect=["backend"])
def test_compressed_padded(backend, mode, pse_type, kind):
    """The 1024-row compressed form with Sq = Skv = 1030 > 1024 (mode 0 reaches d < -1023,
    where the bias is 0)."""
    rng = rng_for("compressed", mode, pse_type, kind)
    args, kw = ao.make_case(rng, "BNSD", B=1, Sq=1030, N1=1, D=4, sparse_mode=mode,
                            pre_tokens=ao.INT_MAX, next_tokens=ao.INT_MAX)
    kw["pse_type"] = pse_type
    geom = bo.Geometry(*args[:2], **kw)
    if kind == "alibi":
        pse = bo.alibi_like_compressed(rng, geom) * np.float32(0.02)
    else:
        pse = bo.make_pse(rng, "compressed", pse_type, geom, batch_one=True)
    check_case(args, kw, pse, rng)


# worked examples (section 7) --------------------------------------------------------------

def zero_query_scores(sq, skv, n1, pse, **kw):
    q = jnp.zeros((1, sq, n1, 4), jnp.float32)
    k = jnp.ones((1, skv, n1, 4), jnp.float32)
    return np.asarray(jr.attention_scores(q, k, pse=jnp.asarray(pse), **kw))


EX1 = np.array([[[0, -0.5, -1, -1.5], [-0.5, 0, -0.5, -1], [-1, -0.5, 0, -0.5]],
                [[0, -0.25, -0.5, -0.75], [-0.25, 0, -0.25, -0.5], [-0.5, -0.25, 0, -0.25]]],
               np.float32)
EX2 = np.array([[[-0.5, 0, -0.5, -1], [-1, -0.5, 0, -0.5], [-1.5, -1, -0.5, 0]]], np.float32)


def test_example_1_2_alibi(backend):
    s = zero_query_scores(3, 4, 2, np.array([0.5, 0.25], np.float32), pse_type=2)
    np.testing.assert_array_equal(s[0], EX1)
    s = zero_query_scores(3, 4, 2, np.array([0.5, 0.25], np.float32), pse_type=2,
                          q_start_idx=1)
    np.testing.assert_array_equal(s[0], np.concatenate([EX2, EX2 / 2]))
    np.testing.assert_array_equal(s[0], bo.alibi_bias_f32(
        np.array([0.5, 0.25], np.float32), 2,
        bo.Geometry(np.zeros((1, 3, 2, 4)), np.zeros((1, 4, 2, 4))), q_start_idx=1)[0])


def test_example_3_sqrt(backend):
    s = zero_query_scores(3, 3, 1, np.array([0.5], np.float32), pse_type=3)[0, 0]
    r = np.float32(-0.5) * np.sqrt(np.float32(2))  # float32 sqrt, one float32 multiply
    exp = np.array([[0, -0.5, r], [-0.5, 0, -0.5], [r, -0.5, 0]], np.float32)
    np.testing.assert_array_equal(s, exp)
    np.testing.assert_allclose(s[0, 2], -0.70710678, rtol=1e-7)


# The CPU kernel's tiles take int32 lanes while every |dist| of the tile stays below 2^30,
# else the exact int64 path: both sides of that bound, and far beyond int32.
@pytest.mark.parametrize("offsets", [(3, -7), (0, 2 ** 30 - 20), (5, 2 ** 30),
                                     (-(2 ** 31), 2 ** 31 - 1)])
@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_bias_exact(backend, pse_type, offsets):
    """With q = 0 the scores are the ALiBi bias itself, bit for bit the spec's float32
    arithmetic: dist exact in integers, |dist| rounded to float32, float32 sqrt, one multiply
    by -slope; padded (every batch) and TND mode 8 (sequence 0 only)."""
    rng = rng_for("exact", pse_type, offsets)
    off = dict(q_start_idx=offsets[0], kv_start_idx=offsets[1])
    slopes = rng.uniform(0.01, 1.0, (2, 3)).astype(np.float32)
    q = np.zeros((2, 7, 3, 4), np.float32)
    k = rng.standard_normal((2, 9, 3, 4)).astype(np.float32)
    s = np.asarray(jax.jit(lambda q, k, p: jr.attention_scores(q, k, pse=p, pse_type=pse_type,
                                                              **off))(q, k, slopes))
    np.testing.assert_array_equal(s, bo.alibi_bias_f32(slopes, pse_type, bo.Geometry(q, k), **off))
    tkw = dict(input_layout="TND", actual_seq_qlen=[3, 7], actual_seq_kvlen=[5, 9],
               sparse_mode=8, pre_tokens=5, next_tokens=ao.INT_MAX)
    qt, kt = np.zeros((7, 3, 4), np.float32), k[0, :, :, :]
    s = np.asarray(jax.jit(lambda q, k, p: jr.attention_scores(
        q, k, pse=p, pse_type=pse_type, **tkw, **off))(qt, kt, slopes))
    exp = bo.alibi_bias_f32(slopes, pse_type, bo.Geometry(qt, kt, **tkw), sparse_mode=8, **off)[0]
    vis = visible([qt, kt], tkw)[0]
    np.testing.assert_array_equal(s[vis], exp[vis])
    np.testing.assert_array_equal(s[~vis], LOWEST)


@pytest.mark.parametrize("pse_type,expected", [(1, 1.5), (0, 2.0)])
def test_example_4_order(backend, pse_type, expected):
    q = jnp.full((1, 1, 1, 1), 2.0, jnp.float32)
    k = jnp.ones((1, 1, 1, 1), jnp.float32)
    s = jr.attention_scores(q, k, scale=0.5, pse=jnp.ones((1, 1, 1, 1), jnp.float32),
                            pse_type=pse_type)
    assert float(s[0, 0, 0, 0]) == expected


def test_example_5_mode8(backend):
    """TND mode 8: sequence 0 uses q_start_idx=1, sequence 1 uses offsets 0."""
    q = jnp.zeros((5, 1, 4), jnp.float32)
    k = jnp.ones((6, 1, 4), jnp.float32)
    s = np.asarray(jr.attention_scores(
        q, k, input_layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6],
        sparse_mode=8, pre_tokens=3, next_tokens=ao.INT_MAX, pse=jnp.array([0.5], jnp.float32),
        pse_type=2, q_start_idx=1))[0]
    np.testing.assert_array_equal(s[:2, :3], [[-0.5, 0, -0.5], [-1, -0.5, 0]])
    seq1 = np.array([[0, -0.5, -1], [-0.5, 0, -0.5], [-1, -0.5, 0]], np.float32)
    vis = ~np.triu(np.ones((3, 3), bool), 1)  # mode 8, other sequences: j > i masked
    np.testing.assert_array_equal(s[2:, 3:][vis], seq1[vis])
    np.testing.assert_array_equal(s[2:, 3:][~vis], LOWEST)
    np.testing.assert_array_equal(s[:2, 3:], LOWEST)
    np.testing.assert_array_equal(s[2:, :3], LOWEST)


@pytest.mark.parametrize("pse_type,pse,expected", [
    (0, np.zeros((1, 1, 1, 2), np.float32), [0.25, -0.25]),
    (1, np.zeros((1, 1, 1, 2), np.float32), [0.125, -0.125]),
    (2, np.zeros((1,), np.float32), [0.25])])
def test_example_7_gradient(backend, pse_type, pse, expected):
    q = np.zeros((1, 1, 1, 1), np.float32)
    k = np.zeros((1, 2, 1, 1), np.float32)
    v = np.array([1.0, 0.0], np.float32).reshape(1, 2, 1, 1)
    got = lib_run([q, k, v], {"scale": 0.5, "pse_type": pse_type}, pse=pse,
                  dout=np.ones((1, 1, 1, 1), np.float32), scores=False)
    np.testing.assert_allclose(got["dpse"].reshape(-1), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["out"].reshape(-1), [0.5], rtol=1e-6)


# outside references -----------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=5)
def _nn_reference(q, k, v, pse, dout, scale):
    """jax.nn.dot_product_attention with bias = scale * pse: (out, dq, dk, dv, dpse)."""
    def nn(q, k, v, pse):
        return jax.nn.dot_product_attention(q, k, v, bias=scale * pse, scale=scale,
                                            implementation="xla")

    out, vjp = jax.vjp(nn, q, k, v, pse)
    return (out, *vjp(dout))


def test_type1_matches_jax_nn_prescaled_bias(backend):
    """pse_type=1: scale*(qk + pse) is jax.nn.dot_product_attention with bias=scale*pse, in
    the forward and every gradient (dpse = scale * dbias)."""
    rng = rng_for("jaxnn")
    B, Sq, Skv, N1, N2, D, scale = 2, 7, 9, 4, 2, 8, 0.3
    q = rng.standard_normal((B, Sq, N1, D)).astype(np.float32)
    k = rng.standard_normal((B, Skv, N2, D)).astype(np.float32)
    v = rng.standard_normal((B, Skv, N2, D)).astype(np.float32)
    pse = rng.standard_normal((B, N1, Sq, Skv)).astype(np.float32)
    dout = rng.standard_normal((B, Sq, N1, D)).astype(np.float32)
    got = lib_run([q, k, v], {"scale": scale, "pse_type": 1}, pse=pse, dout=dout, scores=False)

    exp = _nn_reference(*(jnp.asarray(a) for a in (q, k, v, pse, dout)), scale)
    for name, e in zip(("out", "dq", "dk", "dv", "dpse"), exp):
        assert_close(got[name], np.asarray(e), (1e-4, 1e-5), name)


def test_type2_matches_flash_attn_bottom_right(backend):
    """pse_type=2 with q_start_idx = Skv - Sq is flash-attn's alibi_slopes: the bias
    -slope * |i + Skv - Sq - j| added after the scale (formula written here)."""
    rng = rng_for("flash-attn")
    B, Sq, Skv, N1, D = 2, 5, 9, 3, 8
    scale = 1 / np.sqrt(D)
    q = rng.standard_normal((B, Sq, N1, D)).astype(np.float32)
    k = rng.standard_normal((B, Skv, N1, D)).astype(np.float32)
    v = rng.standard_normal((B, Skv, N1, D)).astype(np.float32)
    slopes = rng.uniform(0.1, 1.0, (B, N1)).astype(np.float32)
    i = np.arange(Sq)[:, None]
    j = np.arange(Skv)[None, :]
    bias = -f64(slopes)[:, :, None, None] * np.abs(i + Skv - Sq - j)
    got = lib_run([q, k, v], {"pse_type": 2, "q_start_idx": Skv - Sq, "sparse_mode": 3},
                  pse=slopes)
    x = np.einsum("bind,bjnd->bnij", f64(q), f64(k))
    causal = j > i + (Skv - Sq)
    exp_s = np.where(causal, ao.FLOAT32_LOWEST, scale * x + bias)
    np.testing.assert_allclose(got["scores"], exp_s, rtol=2e-6, atol=2e-6)
    out = jax.nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                       bias=jnp.asarray(bias, jnp.float32), is_causal=False,
                                       mask=jnp.asarray(~causal)[None, None])
    assert_close(got["out"], np.asarray(out), (2e-5, 2e-5), "out")


# fully masked rows, NaN at masked positions ------------------------------------------------

@pytest.mark.parametrize("case", ["full-mode0", "row-column", "packed-mode3"])
def test_masked_positions_ignore_bias(backend, case):
    """NaN/Inf in pse where every position that reads it is masked change nothing (bit for
    bit), fully masked rows give out 0 and dpse 0, and dpse is 0 at masked entries."""
    rng = rng_for("nan", case)
    if case == "full-mode0":
        args, kw = ao.make_case(rng, "BSND", B=2, Sq=5, Skv=6, N1=2, D=8, sparse_mode=0,
                                atten_mask=ao.random_atten_mask(rng, (2, 1, 5, 6), 0.3))
        kw["atten_mask"][1, 0, 2] = True  # a fully masked row
        kw["pse_type"] = 1
        pse = rng.standard_normal((2, 2, 5, 6)).astype(np.float32)
        bad = np.broadcast_to(kw["atten_mask"], pse.shape)
    elif case == "row-column":
        am = np.zeros((4, 6), bool)
        am[:, 3] = True
        am[1] = True  # fully masked row
        args, kw = ao.make_case(rng, "BNSD", B=1, Sq=4, Skv=6, N1=2, D=8, sparse_mode=0,
                                atten_mask=am)
        kw["pse_type"] = 0
        pse = rng.standard_normal((1, 2, 1, 6)).astype(np.float32)
        bad = np.zeros(pse.shape, bool)
        bad[..., 3] = True
    else:
        args, kw, pse = tnd_case(rng, 1, "packed_full", False, 3, lq=[3, 4], lkv=[2, 5])
        geom = bo.Geometry(*args[:2], **kw)
        idx = bo.bias_index(pse.shape, "packed_full", geom)
        vis = visible(args, kw)
        bad = np.ones(pse.shape, bool)
        bad[idx[vis & (idx >= 0)]] = False
    assert bad.any()
    nan_pse = pse.copy()
    nan_pse[bad] = np.where(rng.random(int(bad.sum())) < 0.5, np.nan, np.inf)
    clean = pse.copy()
    clean[bad] = 0
    dout = rng.standard_normal(ref_run(args, kw, pse=clean)["out"].shape).astype(np.float32)
    ref = ref_run(args, kw, pse=clean, dout=dout)
    fn = lib_fn(kw)
    a = lib_run(args, kw, pse=clean, dout=dout, fn=fn)
    b = lib_run(args, kw, pse=nan_pse, dout=dout, fn=fn)
    compare(a, ref, args, kw, pse=pse)
    for name in a:
        if name == "scores":
            continue
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    masked_scores = ref["scores"] == ao.FLOAT32_LOWEST
    np.testing.assert_array_equal(b["scores"][masked_scores], LOWEST)
    np.testing.assert_array_equal(a["scores"][~masked_scores], b["scores"][~masked_scores])
    np.testing.assert_array_equal(b["dpse"][bad], 0)


# vmap, traced offsets, low precision (everything else runs under jit) ----------------------

@pytest.mark.parametrize("pse_type", [1, 2])
def test_vmap_batched_pse(backend, pse_type):
    """vmap over a stack of pse (and of query): each slice equals its own call."""
    rng = rng_for("vmap", pse_type)
    form = "full" if pse_type == 1 else "slopes"
    args, kw, _ = padded_case(rng, "BNSD", pse_type, form, False, 2, B=1, Sq=4, Skv=5, N1=2,
                              N2=1, offsets=(1, 0))
    geom = bo.Geometry(*args[:2], **kw)
    pses = np.stack([bo.make_pse(rng, form, pse_type, geom, batch_one=True) for _ in range(3)])
    qs = np.stack([args[0], args[0] * 0.5, -args[0]])

    def f(q, pse):
        return jr.flash_attention_score(q, *map(jnp.asarray, args[1:]), pse=pse, **kw)[0]

    def g(q, pse):
        return jax.grad(lambda p: jnp.sum(f(q, p) ** 2))(pse)

    out = np.asarray(jax.jit(jax.vmap(f))(jnp.asarray(qs), jnp.asarray(pses)))
    dp = np.asarray(jax.jit(jax.vmap(g))(jnp.asarray(qs), jnp.asarray(pses)))
    for i in range(3):
        r = ref_run([qs[i], *args[1:]], kw, pse=pses[i])
        assert_close(out[i], r["out"], TOL["float32"], f"out[{i}]")
        d = 2 * f64(r["out"])
        rd = ref_run([qs[i], *args[1:]], kw, pse=pses[i], dout=d)
        assert_close(dp[i], rd["dpse"], GTOL["float32"], f"dpse[{i}]")


@pytest.mark.parametrize("pse_type", [2, 3])
def test_traced_offsets(backend, pse_type):
    """Types 2/3 accept traced int32 offsets: same numbers as the static ones."""
    rng = rng_for("traced", pse_type)
    args, kw, pse = padded_case(rng, "BSND", pse_type, "slopes", True, 0, offsets=(3, -2))
    static = dict(kw)
    traced_kw = {k: v for k, v in kw.items() if k not in ("q_start_idx", "kv_start_idx")}
    dout = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    a = lib_run(args, traced_kw, pse=pse, dout=dout, offsets=(3, -2))
    ref = ref_run(args, static, pse=pse, dout=dout)
    compare(a, ref, args, static, pse=pse)


@pytest.mark.parametrize("dtype,pse_type,form", [("bfloat16", 1, "full"),
                                                 ("float16", 0, "row")])
def test_low_precision(backend, dtype, pse_type, form):
    """pse of the query's dtype; dpse in pse's dtype."""
    dt = DTYPES[dtype]
    rng = rng_for("lowp", dtype)
    args, kw, pse = padded_case(rng, "BSND", pse_type, form, False, 3, dtype=dt)
    check_case(args, kw, pse, rng, scores=False)


def test_no_pse_default_unchanged(backend):
    """pse=None with the default pse_type=1 is plain attention (attention_oracle)."""
    rng = rng_for("nopse")
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=4, Skv=5, N1=2, D=8, sparse_mode=3)
    got = lib_run(args, kw, dout=np.ones((1, 4, 2, 8), np.float32))
    ref = ao.flash_attention_score(*(f64(a) for a in args), **kw)
    assert_close(got["out"], ref[0], TOL["float32"], "out")
    assert got["dpse"] is None
