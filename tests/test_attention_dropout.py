"""Dropout of jr.flash_attention_score and jr.dropout_keep_mask against the float64 oracle
(spec/attention_bias_dropout.md sections 3, 4, 5, 7): Threefry-2x32-20 (known answers and
jax.extend.random.threefry_2x32), the keep mask and its packed bytes (known-answer vectors),
the mask read back through the outputs of both backends (one-hot values), forward/gradients
with dropout (alone and with pse) in every layout, caller-packed dropout_mask, keep rate,
keep_prob = 1, vmap/jit, and the section 5 dropout validation rules."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as ao
import bias_dropout_oracle as bo
import jax_rope as jr
from attention_oracle import f64
from test_attention_bias import (GTOL, TOL, assert_close, compare, lib_run, on_backends,
                                 ref_run, rng_for, visible)


def lib_keep(key, p, q_len, kv_len, **kw):
    """jr.dropout_keep_mask under jit: (bool mask, packed bytes)."""
    f = jax.jit(lambda k: (jr.dropout_keep_mask(k, p, q_len, kv_len, **kw),
                           jr.dropout_keep_mask(k, p, q_len, kv_len, packed=True, **kw)))
    return tuple(np.asarray(x) for x in f(key))


def words(key):
    return tuple(int(w) for w in np.asarray(jax.random.key_data(key)).reshape(-1))


# the oracle itself (NumPy) ----------------------------------------------------------------

def test_threefry_known_answers():
    """Random123 Threefry-2x32-20 known-answer vectors (kat_vectors)."""
    cases = [((0, 0), (0, 0), (0x6b200159, 0x99ba4efe)),
             ((0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff), (0x1cb996fc, 0xbb002be7)),
             ((0x13198a2e, 0x03707344), (0x243f6a88, 0x85a308d3), (0xc4923a9c, 0x483df7a0))]
    for key, ctr, exp in cases:
        y = bo.threefry2x32(key[0], key[1], ctr[0], ctr[1])
        assert (int(y[0]), int(y[1])) == exp, (key, ctr, [hex(int(v)) for v in y])


def test_threefry_matches_jax():
    """The oracle's hash equals jax.extend.random.threefry_2x32 (y0 in the first half)."""
    from jax.extend.random import threefry_2x32
    rng = np.random.default_rng(5)
    for _ in range(3):
        k = rng.integers(0, 2 ** 32, 2, dtype=np.uint64).astype(np.uint32)
        r = rng.integers(0, 2 ** 32, 257, dtype=np.uint64).astype(np.uint32)
        c = rng.integers(0, 2 ** 32, 257, dtype=np.uint64).astype(np.uint32)
        y = np.asarray(threefry_2x32(jnp.asarray(k), jnp.asarray(np.concatenate([r, c]))))
        y0, y1 = bo.threefry2x32(k[0], k[1], r, c)
        np.testing.assert_array_equal(y0, y[:257])
        np.testing.assert_array_equal(y1, y[257:])


def test_oracle_known_answers():
    keep = bo.keep_mask((0, 0), 0.5, 2, 5)
    np.testing.assert_array_equal(keep[0, 0], [[1, 1, 0, 0, 0], [1, 0, 1, 1, 1]])
    np.testing.assert_array_equal(bo.pack_bits(keep), [0xA3, 0x03] + [0] * 14)
    keep = bo.keep_mask((0, 42), 0.9, 3, 3, batch=2, heads=2)
    np.testing.assert_array_equal(bo.pack_bits(keep), [0xFF, 0xFF, 0xFD, 0xFC, 0x0F] + [0] * 11)


def test_pack_example_8():
    bits = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], bool)
    packed = bo.pack_bits(bits)
    np.testing.assert_array_equal(packed, [0xED, 0x02] + [0] * 14)
    np.testing.assert_array_equal(bo.unpack_bits(packed, 10), bits)
    assert bo.packed_size(128) == 16 and bo.packed_size(129) == 32


# jr.dropout_keep_mask ---------------------------------------------------------------------

def test_keep_mask_known_answers():
    keep = np.asarray(jr.dropout_keep_mask(jax.random.key(0), 0.5, 2, 5))
    assert keep.dtype == np.bool_ and keep.shape == (1, 1, 2, 5), (keep.dtype, keep.shape)
    np.testing.assert_array_equal(keep[0, 0], [[1, 1, 0, 0, 0], [1, 0, 1, 1, 1]])
    packed = np.asarray(jr.dropout_keep_mask(jax.random.key(0), 0.5, 2, 5, packed=True))
    assert packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, [0xA3, 0x03] + [0] * 14)
    packed = lib_keep(jax.random.key(42), 0.9, 3, 3, batch=2, heads=2)[1]
    np.testing.assert_array_equal(packed, [0xFF, 0xFF, 0xFD, 0xFC, 0x0F] + [0] * 11)


@pytest.mark.parametrize("case", ["padded", "tiles", "legacy-key", "tnd"])
def test_keep_mask_matches_oracle(case):
    p = {"padded": 0.7, "tiles": 0.3, "legacy-key": 0.55, "tnd": 0.6}[case]
    key = jax.random.PRNGKey(7) if case == "legacy-key" else jax.random.key(123)
    if case == "tnd":
        lq, lkv = [3, 0, 5, 2], [4, 1, 6, 2]
        tq, tkv, B, N = sum(lq), sum(lkv), 1, 2
        kw_ = dict(actual_seq_qlen=ao.cumulative(lq), actual_seq_kvlen=ao.cumulative(lkv),
                   heads=N)
        exp = bo.keep_mask(words(key), p, tq, tkv, heads=N, seq_q=lq, seq_kv=lkv)
        bits = bo.element_bits(exp, seq_q=lq, seq_kv=lkv)
    else:
        B, N, tq, tkv = {"padded": (2, 3, 7, 11), "tiles": (1, 2, 130, 70),
                         "legacy-key": (3, 1, 2, 9)}[case]
        kw_ = dict(batch=B, heads=N)
        exp = bo.keep_mask(words(key), p, tq, tkv, batch=B, heads=N)
        bits = bo.element_bits(exp)
    got, packed = lib_keep(key, p, tq, tkv, **kw_)
    assert got.dtype == np.bool_ and got.shape == exp.shape, (got.dtype, got.shape, exp.shape)
    np.testing.assert_array_equal(got, exp)
    np.testing.assert_array_equal(packed, bo.pack_bits(bits))


def test_keep_mask_tnd_equal_lengths_equals_padded():
    """TND with equal lengths uses the BSND position words."""
    key = jax.random.key(9)
    B, N, S = 3, 2, 5
    pad, pad_packed = lib_keep(key, 0.5, S, S, batch=B, heads=N)
    tnd, tnd_packed = lib_keep(key, 0.5, B * S, B * S, heads=N, actual_seq_qlen=[5, 10, 15],
                               actual_seq_kvlen=[5, 10, 15])
    for b in range(B):
        np.testing.assert_array_equal(tnd[:, b * S:(b + 1) * S, b * S:(b + 1) * S], pad[b])
    np.testing.assert_array_equal(pad_packed, tnd_packed)


@pytest.mark.parametrize("p", [0.7, 0.1])
def test_keep_rate(p):
    """The share of kept positions over 2*512*512 draws is within 4 sigma of keep_prob."""
    keep = lib_keep(jax.random.key(2024), p, 512, 512, heads=2)[0]
    n = keep.size
    assert abs(keep.mean() - p) < 4 * math.sqrt(p * (1 - p) / n), keep.mean()


# the mask read back through the outputs ---------------------------------------------------

def one_hot_case(layout, mode, rng):
    """q = 0 (uniform softmax over the visible keys) and v_j = e_j, so that
    out[i, j] = keep[i, j] / (visible keys of row i * keep_prob)."""
    if layout == "TND":
        lq, lkv = [3, 0, 5, 4], [4, 2, 6, 4]
        tkv = sum(lkv)
        args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=tkv, seq_q=lq, seq_kv=lkv,
                                sparse_mode=mode)
        v4 = np.eye(tkv)[None, None]
    else:
        B, Sq, Skv = (2, 5, 7) if layout == "BSND" else (1, 130, 150)
        args, kw = ao.make_case(rng, layout, B=B, Sq=Sq, Skv=Skv, N1=2, N2=1, D=Skv,
                                sparse_mode=mode)
        v4 = np.broadcast_to(np.eye(Skv), (B, 1, Skv, Skv))
    args[0] = np.zeros_like(args[0])
    args[2] = ao.from_bnsd(v4, layout).astype(np.float32)
    return args, kw


@pytest.mark.parametrize("layout,mode", [("BSND", 0), ("BNSD", 2), ("TND", 3)])
def test_keep_mask_through_outputs(backend, layout, mode):
    """out reveals Pr * keep / keep_prob: the kept positions equal jr.dropout_keep_mask's (and
    the oracle's) bit for bit, on both backends, across tiles (130 x 150)."""
    rng = rng_for("onehot", layout, mode)
    p = 0.6
    key = jax.random.key(77)
    args, kw = one_hot_case(layout, mode, rng)
    kw = dict(kw, keep_prob=p)
    geom = bo.Geometry(*args[:2], **kw)
    got = lib_run(args, kw, dropout_key=key, scores=False)
    out4 = ao.to_bnsd(got["out"], layout, geom.n1)
    vis = visible(args, kw)
    if layout == "TND":
        keep = lib_keep(key, p, geom.grid[2], geom.grid[3], heads=geom.n1,
                        actual_seq_qlen=kw["actual_seq_qlen"],
                        actual_seq_kvlen=kw["actual_seq_kvlen"])[0][None]
    else:
        keep = lib_keep(key, p, geom.sq, geom.skv, batch=geom.batch, heads=geom.n1)[0]
    exp_keep = bo.keep_grid(words(key), p, geom)
    np.testing.assert_array_equal(keep, exp_keep)
    np.testing.assert_array_equal(out4 > 0, exp_keep & vis)
    nvis = vis.sum(-1, keepdims=True)
    expected = np.where(exp_keep & vis, 1.0 / (np.maximum(nvis, 1) * p), 0.0)
    np.testing.assert_allclose(out4, expected, rtol=2e-6, atol=0)


# forward and gradients with dropout --------------------------------------------------------

DROP_CASES = {
    # name: (layout, mode, pse_type, form, keep_prob)
    "bsnd-0": ("BSND", 0, None, None, 0.8),
    "bnsd-3-full": ("BNSD", 3, 1, "full", 0.5),
    "sbh-4-alibi": ("SBH", 4, 2, "slopes", 0.7),
    "bsh-6-row": ("BSH", 6, 0, "row", 0.9),
    "tnd-8-sqrt": ("TND", 8, 3, "slopes", 0.6),
    "tnd-2-packed": ("TND", 2, 1, "packed_row", 0.75),
    "tiles": ("BSND", 3, 1, "full", 0.5),
}


def drop_case(name, rng):
    layout, mode, pse_type, form, p = DROP_CASES[name]
    if layout == "TND":
        lq, lkv = [3, 0, 4, 2], [4, 0, 5, 2]
        args, kw = ao.make_case(rng, "TND", N1=4, N2=2, D=8, seq_q=lq, seq_kv=lkv,
                                **ao.varlen_kwargs(mode, rng, lq, lkv))
    else:
        B, Sq, Skv = (1, 150, 200) if name == "tiles" else (2, 5, 6)
        args, kw = ao.make_case(rng, layout, B=B, Sq=Sq, Skv=Skv, N1=4, N2=2, D=8,
                                **ao.mode_kwargs(mode, rng, B, Sq, Skv, 4))
    kw["keep_prob"] = p
    pse = None
    if pse_type is not None:
        kw["pse_type"] = pse_type
        if pse_type >= 2:
            kw["q_start_idx"], kw["kv_start_idx"] = (1, 0)
        pse = bo.make_pse(rng, form, pse_type, bo.Geometry(*args[:2], **kw))
    return args, kw, pse


@pytest.mark.parametrize("backend,name", on_backends([(n,) for n in DROP_CASES], {0, 2, 4, 6}),
                         indirect=["backend"])
def test_dropout_vs_oracle(backend, name):
    """Forward (statistics undropped), dq/dk/dv/dpse with the regenerated mask."""
    rng = rng_for("drop", name)
    args, kw, pse = drop_case(name, rng)
    key = jax.random.key(int(rng.integers(0, 2 ** 31)))
    geom = bo.Geometry(*args[:2], **kw)
    keep = bo.keep_grid(words(key), kw["keep_prob"], geom)
    ref0 = ref_run(args, kw, pse=pse)
    dout = rng.standard_normal(ref0["out"].shape).astype(np.float32)
    ref = ref_run(args, kw, pse=pse, dout=dout, keep=keep)
    got = lib_run(args, kw, pse=pse, dout=dout, dropout_key=key, scores=False)
    compare(got, ref, args, kw, pse=pse, what=name)  # statistics: the undropped softmax's


@pytest.mark.parametrize("name", ["tnd-8-sqrt"])
def test_dropout_mask_equals_key(backend, name):
    """A caller-packed dropout_mask made by jr.dropout_keep_mask(packed=True) gives the same
    forward and gradients as the key that made it."""
    rng = rng_for("mask-eq", name)
    args, kw, pse = drop_case(name, rng)
    key = jax.random.key(31)
    geom = bo.Geometry(*args[:2], **kw)
    if geom.varlen:
        packed = lib_keep(key, kw["keep_prob"], geom.grid[2], geom.grid[3], heads=geom.n1,
                          actual_seq_qlen=kw["actual_seq_qlen"],
                          actual_seq_kvlen=kw["actual_seq_kvlen"])[1]
    else:
        packed = lib_keep(key, kw["keep_prob"], geom.sq, geom.skv, batch=geom.batch,
                          heads=geom.n1)[1]
    dout = rng.standard_normal(ref_run(args, kw, pse=pse)["out"].shape).astype(np.float32)
    a = lib_run(args, kw, pse=pse, dout=dout, dropout_key=key, scores=False)
    b = lib_run(args, kw, pse=pse, dout=dout, dropout_mask=packed, scores=False)
    for name_ in a:
        if a[name_] is not None:
            np.testing.assert_allclose(b[name_], a[name_], rtol=1e-6, atol=1e-7, err_msg=name_)


@pytest.mark.parametrize("backend,layout", on_backends([("TND",), ("BNSD",)], {0}),
                         indirect=["backend"])
def test_caller_mask(backend, layout):
    """An arbitrary caller mask (as from torch_npu) of exactly ceil(numel/8) bytes, and the
    same bits in a longer buffer with junk past numel: the oracle's result, and equal."""
    rng = rng_for("caller", layout)
    if layout == "TND":
        lq, lkv = [2, 3, 1], [3, 3, 4]
        args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                                sparse_mode=0)
    else:
        args, kw = ao.make_case(rng, "BNSD", B=2, Sq=3, Skv=5, N1=2, N2=1, D=8, sparse_mode=2)
    kw["keep_prob"] = 0.7
    geom = bo.Geometry(*args[:2], **kw)
    numel = sum(geom.n1 * a * c for a, c in zip(geom.seq_q, geom.seq_kv))
    bits = rng.random(numel) < 0.7
    exact = bo.pack_bits(bits, size=-(-numel // 8))
    longer = np.concatenate([exact, rng.integers(0, 256, 9).astype(np.uint8)])
    tail = numel % 8
    if tail:
        longer[numel >> 3] |= np.uint8((0xFF << tail) & 0xFF)  # junk bits past numel
    keep = bo.keep_grid_from_bits(bits, geom)
    dout = rng.standard_normal(ref_run(args, kw)["out"].shape).astype(np.float32)
    ref = ref_run(args, kw, dout=dout, keep=keep)
    a = lib_run(args, kw, dout=dout, dropout_mask=exact)
    b = lib_run(args, kw, dout=dout, dropout_mask=longer)
    compare(a, ref, args, kw)
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_example_6(backend):
    """Pr [0.5, 0.25, 0.25] (from a type-0 bias log Pr), keep [1, 0, 1], keep_prob 0.8,
    v = [1, 2, 3]: out 1.5625, softmax_sum 2 (undropped)."""
    q = np.zeros((1, 1, 1, 1), np.float32)
    k = np.zeros((1, 3, 1, 1), np.float32)
    v = np.array([1, 2, 3], np.float32).reshape(1, 3, 1, 1)
    pse = np.log(np.array([0.5, 0.25, 0.25])).astype(np.float32).reshape(1, 1, 1, 3)
    got = lib_run([q, k, v], {"pse_type": 0, "keep_prob": 0.8}, pse=pse,
                  dropout_mask=np.array([0b101], np.uint8), scores=False)
    np.testing.assert_allclose(got["out"].reshape(-1), [1.5625], rtol=1e-6)
    np.testing.assert_allclose(got["sum"].reshape(-1), [2.0], rtol=1e-6)
    np.testing.assert_allclose(got["max"].reshape(-1), [np.log(0.5)], rtol=1e-6)


def test_keep_prob_one_ignores_key_and_mask(backend):
    rng = rng_for("p1")
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=4, Skv=5, N1=2, D=8, sparse_mode=3)
    dout = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    plain = lib_run(args, kw, dout=dout)
    both = lib_run(args, dict(kw, keep_prob=1.0), dout=dout, dropout_key=jax.random.key(1),
                   dropout_mask=np.zeros(16, np.uint8))
    for name in plain:
        if plain[name] is not None:
            np.testing.assert_array_equal(both[name], plain[name], err_msg=name)


def test_vmap(backend):
    """vmap over keys (each its own mask) and over queries with one key (each call sees its
    own indices): every slice equals its own call."""
    rng = rng_for("vmap")
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=4, Skv=6, N1=2, D=8, sparse_mode=0)
    kw["keep_prob"] = 0.6
    keys = jax.random.split(jax.random.key(3), 3)
    qs = np.stack([args[0], 2 * args[0], -args[0]])
    k, v = map(jnp.asarray, args[1:])

    def f(q, key):
        return jr.flash_attention_score(q, k, v, dropout_key=key, **kw)[0]

    def g(q, key):
        return jax.grad(lambda q: jnp.sum(f(q, key) ** 2))(q)

    out_k = np.asarray(jax.jit(jax.vmap(f, in_axes=(None, 0)))(jnp.asarray(args[0]), keys))
    out_q = np.asarray(jax.jit(jax.vmap(f, in_axes=(0, None)))(jnp.asarray(qs), keys[0]))
    dq_k = np.asarray(jax.jit(jax.vmap(g, in_axes=(None, 0)))(jnp.asarray(args[0]), keys))
    geom = bo.Geometry(*args[:2], **kw)
    for i in range(3):
        keep = bo.keep_grid(words(keys[i]), 0.6, geom)
        r = ref_run(args, kw, keep=keep)
        assert_close(out_k[i], r["out"], TOL["float32"], f"keys[{i}]")
        rd = ref_run(args, kw, keep=keep, dout=2 * f64(r["out"]))
        assert_close(dq_k[i], rd["dq"], GTOL["float32"], f"dq keys[{i}]")
        keep0 = bo.keep_grid(words(keys[0]), 0.6, geom)
        r = ref_run([qs[i], *args[1:]], kw, keep=keep0)
        assert_close(out_q[i], r["out"], TOL["float32"], f"queries[{i}]")


# validation (section 5) -------------------------------------------------------------------

def S(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


A = [S(2, 4, 2, 8), S(2, 5, 2, 8), S(2, 5, 2, 8)]


def trace(abstract=A, **kw):
    return jax.eval_shape(lambda q, k, v: jr.flash_attention_score(q, k, v, **kw), *abstract)


KEY = jax.random.key(0)


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_keep_prob_range(p):
    with pytest.raises(ValueError, match="keep_prob"):
        trace(keep_prob=p, dropout_key=KEY)


@pytest.mark.parametrize("p", ["0.5", None, [0.5], 1j])
def test_keep_prob_type(p):
    with pytest.raises(TypeError, match="keep_prob"):
        trace(keep_prob=p, dropout_key=KEY)


def test_keep_prob_traced():
    with pytest.raises(TypeError, match="keep_prob"):
        jax.eval_shape(lambda q, k, v, p: jr.flash_attention_score(
            q, k, v, keep_prob=p, dropout_key=KEY), *A, S())


def test_key_or_mask_exactly_one():
    with pytest.raises(ValueError, match="dropout_key|dropout_mask"):
        trace(keep_prob=0.5)
    with pytest.raises(ValueError, match="dropout_key|dropout_mask"):
        trace(keep_prob=0.5, dropout_key=KEY, dropout_mask=np.zeros(16, np.uint8))
    trace(keep_prob=0.5, dropout_key=KEY)
    trace(keep_prob=0.5, dropout_key=jax.random.PRNGKey(0))
    trace(keep_prob=0.5, dropout_mask=np.zeros(10, np.uint8))  # ceil(80 / 8)
    trace(keep_prob=1.0, dropout_key=KEY, dropout_mask=np.zeros(16, np.uint8))


@pytest.mark.parametrize("bad", ["zeros3", "float", "rbg", "int", "batched"])
def test_bad_key(bad):
    key = {"zeros3": lambda: jnp.zeros(3, jnp.uint32), "float": lambda: jnp.zeros(2),
           "rbg": lambda: jax.random.key(0, impl="rbg"), "int": lambda: 0,
           "batched": lambda: jax.random.split(KEY, 2)}[bad]()
    with pytest.raises(TypeError, match="dropout_key"):
        trace(keep_prob=0.5, dropout_key=key)


@pytest.mark.parametrize("bad", ["2d", "int8", "bool", "short", "float"])
def test_bad_dropout_mask(bad):
    m = {"2d": np.zeros((2, 8), np.uint8), "int8": np.zeros(16, np.int8),
         "bool": np.zeros(128, bool), "short": np.zeros(9, np.uint8),
         "float": np.zeros(16, np.float32)}[bad]
    with pytest.raises(ValueError, match="dropout_mask"):
        trace(keep_prob=0.5, dropout_mask=m)


def test_dropout_mask_tnd_needs_concrete_lengths():
    a = [S(5, 2, 8), S(6, 2, 8), S(6, 2, 8)]

    def f(q, k, v, cq, ckv):
        return jr.flash_attention_score(q, k, v, input_layout="TND", actual_seq_qlen=cq,
                                        actual_seq_kvlen=ckv, keep_prob=0.5,
                                        dropout_mask=np.zeros(16, np.uint8))

    lens = (jnp.array([2, 5], jnp.int32), jnp.array([3, 6], jnp.int32))
    with pytest.raises(ValueError, match="dropout_mask|actual_seq"):
        jax.eval_shape(f, *a, *lens)
    # concrete lengths: numel 2*(2*3 + 3*3) = 30 bits -> 4 bytes enough, 3 too short
    kw = dict(input_layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6],
              keep_prob=0.5)
    trace(a, dropout_mask=np.zeros(4, np.uint8), **kw)
    with pytest.raises(ValueError, match="dropout_mask"):
        trace(a, dropout_mask=np.zeros(3, np.uint8), **kw)


def test_position_words_fit_uint32():
    """B*N1*Sq at least 2**32: ValueError (the same call without dropout traces). (Skv >= 2**32
    is already beyond attention.md's sequence limit.)"""
    a = [S(2 ** 12, 2 ** 10, 2 ** 10, 1), S(2 ** 12, 1, 1, 1), S(2 ** 12, 1, 1, 1)]
    trace(a, input_layout="BNSD")
    with pytest.raises(ValueError):
        trace(a, input_layout="BNSD", keep_prob=0.5, dropout_key=KEY)
    b = [S(2 ** 12, 2 ** 10, 2 ** 10 - 1, 1), S(2 ** 12, 1, 1, 1), S(2 ** 12, 1, 1, 1)]
    trace(b, input_layout="BNSD", keep_prob=0.5, dropout_key=KEY)
