"""One test per validation rule of spec/attention.md: bad input raises ValueError/TypeError
naming the argument, at trace time (eagerly, and for a few rules under jax.jit and
jax.eval_shape). Calls that the rules allow must not raise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as ao
import jax_rope as jr

F32, F16, BF16, I32 = jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32
ERR = (ValueError, TypeError)
TOKENS = "pre_tokens|next_tokens"
HOW = ["eager", "jit", "eval_shape"]


def inputs(layout="BSND", B=2, Sq=4, Skv=5, N1=4, N2=2, D=8, Dv=None, dtypes=(F32,) * 3,
           lq=None, lkv=None):
    """(query, key, value) zeros; for TND the token counts come from the lengths lq/lkv."""
    Dv = D if Dv is None else Dv
    if layout == "TND":
        Sq, Skv = sum(lq), sum(lkv)
    shapes = (ao.layout_shape(layout, B, Sq, N1, D), ao.layout_shape(layout, B, Skv, N2, D),
              ao.layout_shape(layout, B, Skv, N2, Dv))
    return [jnp.zeros(s, dt) for s, dt in zip(shapes, dtypes)]


def tnd_kw(lq, lkv):
    return dict(input_layout="TND", actual_seq_qlen=ao.cumulative(lq),
                actual_seq_kvlen=ao.cumulative(lkv))


def invoke(args, kw, how="eager", fn=None):
    fn = fn or jr.flash_attention_score

    def f(q, k, v):
        return fn(q, k, v, **kw) if fn is jr.flash_attention_score else fn(q, k, **kw)

    if how == "eager":
        out = f(*args)
        jax.block_until_ready(out)
    elif how == "jit":
        jax.jit(f).lower(*args)
    else:
        jax.eval_shape(f, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))


def bad(match, args, kw, how="eager", fn=None):
    with pytest.raises(ERR, match=match):
        invoke(args, kw, how, fn)


def good(args, kw, how="eval_shape"):
    """An allowed call passes validation (traced only: nothing needs computing)."""
    invoke(args, kw, how)


# sparse_mode ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("mode", [-1, 9, 100])
def test_sparse_mode_range(mode, how):
    bad("sparse_mode", inputs(), dict(sparse_mode=mode), how)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
@pytest.mark.parametrize("mode", [7, 8])
def test_modes_7_8_need_tnd(mode, layout):
    kw = dict(sparse_mode=mode, pre_tokens=5, next_tokens=0)
    if layout in ("BSH", "SBH"):
        kw["head_num"] = 4
    bad("sparse_mode|input_layout|TND", inputs(layout, Sq=5, Skv=5), dict(kw,
                                                                          input_layout=layout))


def test_mode5_not_with_tnd():
    lq, lkv = [2, 3], [3, 3]
    kw = dict(tnd_kw(lq, lkv), sparse_mode=5, prefix=[1, 1],
              atten_mask=np.zeros((3, 3), bool))
    bad("sparse_mode|input_layout|TND", inputs("TND", lq=lq, lkv=lkv), kw)


@pytest.mark.parametrize("mode", [5, 6])
def test_prefix_required(mode):
    kw = dict(sparse_mode=mode)
    if mode == 5:
        kw["atten_mask"] = ao.dense_mask(6, 4, 5, prefix=[2, 3])
    bad("prefix", inputs(), kw)


@pytest.mark.parametrize("mode", [1, 5])
def test_atten_mask_required(mode):
    kw = dict(sparse_mode=mode)
    if mode == 5:
        kw["prefix"] = [2, 3]
    bad("atten_mask", inputs(), kw)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("shape", [(5, 5), (4, 6), (4, 4), (1, 4, 5), (3, 1, 4, 5),
                                   (2, 3, 4, 5), (2, 2, 4, 5), (1, 1, 1, 4, 5), (5,)],
                         ids=str)
@pytest.mark.parametrize("mode", [0, 1])
def test_atten_mask_bad_shape(mode, shape, how):
    """B=2, N1=4, Sq=4, Skv=5: only (4,5), (1,1,4,5), (2,1,4,5), (2,4,4,5) are accepted."""
    bad("atten_mask", inputs(), dict(sparse_mode=mode, atten_mask=np.zeros(shape, bool)), how)


@pytest.mark.parametrize("shape", [(4, 5), (1, 1, 4, 5), (2, 1, 4, 5), (2, 4, 4, 5)], ids=str)
def test_atten_mask_accepted_shapes(shape):
    for dtype in (bool, np.uint8):
        good(inputs(), dict(sparse_mode=1, atten_mask=np.zeros(shape, dtype)))


def test_atten_mask_bad_shape_tnd():
    """TND takes (maxSq, maxSkv)."""
    lq, lkv = [2, 3], [4, 1]
    kw = tnd_kw(lq, lkv)
    good(inputs("TND", lq=lq, lkv=lkv), dict(kw, sparse_mode=1,
                                              atten_mask=np.zeros((3, 4), bool)))
    for shape in [(2, 4), (3, 3), (5, 5, 1)]:
        bad("atten_mask", inputs("TND", lq=lq, lkv=lkv),
            dict(kw, sparse_mode=1, atten_mask=np.zeros(shape, bool)))


@pytest.mark.parametrize("mode", [2, 3, 4, 6])
def test_compressed_mask_shape(mode):
    """Modes 2, 3, 4, 6: an atten_mask must be exactly the compressed one (2048x2048, or
    3072x2048 for mode 6); a dense (Sq, Skv) mask or the other compressed shape is an error."""
    kw = dict(sparse_mode=mode)
    if mode == 4:
        kw.update(pre_tokens=2, next_tokens=1)
    if mode == 6:
        kw["prefix"] = [2, 3]
    good(inputs(), dict(kw, atten_mask=ao.compressed_mask(mode)))
    wrong = ao.compressed_mask(2 if mode == 6 else 6)
    for m in (np.zeros((4, 5), bool), np.zeros((2, 1, 4, 5), bool), wrong):
        bad("atten_mask", inputs(), dict(kw, atten_mask=m))


@pytest.mark.parametrize("mode", [7, 8])
def test_compressed_mask_shape_varlen(mode):
    lq, lkv = [3, 2], [3, 6]
    kw = dict(tnd_kw(lq, lkv), sparse_mode=mode, pre_tokens=6 if mode == 7 else 3,
              next_tokens=-2 if mode == 7 else 0)
    good(inputs("TND", lq=lq, lkv=lkv), dict(kw, atten_mask=ao.compressed_mask(mode)))
    bad("atten_mask", inputs("TND", lq=lq, lkv=lkv), dict(kw, atten_mask=np.zeros((3, 6), bool)))


# band -------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("pre,nxt", [(-1, -1), (-2, 1), (-4, 10), (1, -2), (10, -4)])
def test_band_rules_mode4(pre, nxt, how):
    """Sq == Skv == 4: both negative; pre<0 needs next >= -pre and -pre < Skv; next<0 needs
    -next <= pre and -next < Sq."""
    bad(TOKENS, inputs(Sq=4, Skv=4), dict(sparse_mode=4, pre_tokens=pre, next_tokens=nxt),
        how)


@pytest.mark.parametrize("pre,nxt", [(-1, 2), (-3, 3), (2, -1), (3, -3), (0, 0)])
def test_band_rules_mode4_allowed(pre, nxt):
    good(inputs(Sq=4, Skv=4), dict(sparse_mode=4, pre_tokens=pre, next_tokens=nxt))


@pytest.mark.parametrize("sq,skv,pre,nxt,ok", [
    (2, 6, 3, -4, False),  # pre' = -1, next' = 0 < 1
    (2, 6, 3, -3, True),  # pre' = -1, next' = 1
    (2, 6, -3, 10, False),  # pre' = -7: -pre' >= Skv
    (6, 2, -4, 0, False),  # pre' = 0, next' = -4: -next' > pre'
    (6, 2, 0, 0, True),  # pre' = 4, next' = -4
    (6, 2, 3, -3, False),  # pre' = 7, next' = -7: -next' >= Sq
])
def test_band_rules_after_conversion(sq, skv, pre, nxt, ok):
    """Mode 4 converts to top-left first: pre' = pre - delta, next' = next + delta."""
    assert ao.band_valid(*ao.to_top_left(4, pre, nxt, sq, skv), sq, skv) == ok
    args, kw = inputs(Sq=sq, Skv=skv), dict(sparse_mode=4, pre_tokens=pre, next_tokens=nxt)
    if ok:
        good(args, kw)
    else:
        bad(TOKENS, args, kw)


@pytest.mark.parametrize("pre,nxt", [(-1, -1), (-2, 1), (1, -2)])
def test_band_rules_mode0_with_mask(pre, nxt):
    bad(TOKENS, inputs(Sq=4, Skv=4), dict(sparse_mode=0, pre_tokens=pre, next_tokens=nxt,
                                          atten_mask=np.zeros((4, 4), bool)))


@pytest.mark.parametrize("pre,nxt,ok", [(6, -2, True), (5, -2, False), (6, 1, False),
                                        (6, -5, False), (6, -4, True), (6, 0, True)])
def test_mode7_token_rules(pre, nxt, ok):
    """Last sequence Sq=2, Skv=6: pre >= 6 and 2 - 6 <= next <= 0."""
    lq, lkv = [3, 2], [3, 6]
    args = inputs("TND", lq=lq, lkv=lkv)
    kw = dict(tnd_kw(lq, lkv), sparse_mode=7, pre_tokens=pre, next_tokens=nxt)
    good(args, kw) if ok else bad(TOKENS, args, kw)


@pytest.mark.parametrize("pre,nxt,ok", [(4, 1, True), (3, 1, False), (4, -2, False),
                                        (4, -1, True), (9, 5, True)])
def test_mode8_token_rules(pre, nxt, ok):
    """First sequence Sq=3, Skv=4: pre >= 4 and next >= 3 - 4."""
    lq, lkv = [3, 5, 4], [4, 5, 4]
    args = inputs("TND", lq=lq, lkv=lkv)
    kw = dict(tnd_kw(lq, lkv), sparse_mode=8, pre_tokens=pre, next_tokens=nxt)
    good(args, kw) if ok else bad(TOKENS, args, kw)


# dtypes, heads, shapes -----------------------------------------------------------------------

@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("dtypes", [(F32, BF16, F32), (F16, F16, F32), (BF16, BF16, F16)],
                         ids=str)
def test_dtype_mismatch(dtypes, how):
    bad("dtype|query|key|value", inputs(dtypes=dtypes), dict(sparse_mode=2), how)


@pytest.mark.parametrize("dt", [I32, jnp.int8, jnp.complex64], ids=str)
def test_unsupported_dtype(dt):
    bad("dtype|query|key|value", inputs(dtypes=(dt,) * 3), dict(sparse_mode=2))


@pytest.mark.parametrize("n1,n2", [(3, 2), (2, 4), (5, 3)])
def test_heads_not_divisible(n1, n2):
    bad("head|query|key|N1|N2", inputs(N1=n1, N2=n2), {})
    bad("head|query|key|N1|N2", inputs("BNSD", N1=n1, N2=n2), dict(input_layout="BNSD"))


@pytest.mark.parametrize("layout", ["BSH", "SBH"])
def test_head_num_missing(layout):
    bad("head_num", inputs(layout), dict(input_layout=layout))


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("layout", ["BSH", "SBH"])
def test_head_num_inconsistent(layout, how):
    args = inputs(layout, N1=4, N2=2, D=8)  # query hidden 32, key hidden 16
    good(args, dict(input_layout=layout, head_num=4))
    for hn in (5, 0, -4, 64):
        bad("head_num", args, dict(input_layout=layout, head_num=hn), how)


@pytest.mark.parametrize("layout", ["BSH", "SBH"])
def test_key_hidden_not_multiple_of_d(layout):
    q, _, _ = inputs(layout, N1=4, D=8)
    shape = (2, 5, 12) if layout == "BSH" else (5, 2, 12)
    k = jnp.zeros(shape, F32)
    bad("key|head_num|value", [q, k, k], dict(input_layout=layout, head_num=4))


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
@pytest.mark.parametrize("axis", ["B", "Sq", "Skv"])
def test_empty_axis(layout, axis):
    sizes = dict(B=2, Sq=4, Skv=5)
    sizes[axis] = 0
    kw = dict(input_layout=layout)
    if layout in ("BSH", "SBH"):
        kw["head_num"] = 4
    bad("query|key|value|empty", inputs(layout, **sizes), kw)


def test_d_mismatch():
    q, _, _ = inputs(D=8)
    _, k, v = inputs(D=6)
    bad("key|query|head dim|D", [q, k, v], {})


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
def test_dv_larger_than_d(layout):
    extra = dict(lq=[2, 2], lkv=[3, 1]) if layout == "TND" else {}
    kw = tnd_kw([2, 2], [3, 1]) if layout == "TND" else dict(input_layout=layout)
    good(inputs(layout, D=8, Dv=4, **extra), kw)
    bad("value", inputs(layout, D=8, Dv=16, **extra), kw)


def test_key_value_mismatch():
    q, k, _ = inputs()
    bad("key|value", [q, k, jnp.zeros((2, 6, 2, 8), F32)], {})  # Skv 6 vs 5
    bad("key|value", [q, k, jnp.zeros((2, 5, 1, 8), F32)], {})  # N2 1 vs 2
    bad("key|query", [q, jnp.zeros((3, 5, 2, 8), F32), jnp.zeros((3, 5, 2, 8), F32)], {})


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("layout", ["XYZ", "SBND", "BSHD", ""])
def test_bad_layout(layout, how):
    bad("input_layout", inputs(), dict(input_layout=layout), how)


# varlen -------------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["actual_seq_qlen", "actual_seq_kvlen", "both"])
def test_actual_seq_missing_for_tnd(missing):
    lq, lkv = [2, 3], [3, 3]
    kw = tnd_kw(lq, lkv)
    for name in ("actual_seq_qlen", "actual_seq_kvlen"):
        if missing in (name, "both"):
            del kw[name]
    bad("actual_seq", inputs("TND", lq=lq, lkv=lkv), kw)


def test_actual_seq_different_lengths():
    args = inputs("TND", lq=[2, 3], lkv=[3, 3])
    bad("actual_seq", args, dict(input_layout="TND", actual_seq_qlen=[2, 5],
                                 actual_seq_kvlen=[6]))
    bad("actual_seq", args, dict(input_layout="TND", actual_seq_qlen=[2, 5],
                                 actual_seq_kvlen=[3, 3, 6]))


# prefix -------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("prefix", [[6, 3], [2, -1], [0, 3], [3], [3, 3, 3]], ids=str)
def test_prefix_out_of_range(prefix, how):
    """Sq=4, Skv=5: max(Skv - Sq, 0) = 1 <= prefix[b] <= 5, length B=2."""
    bad("prefix", inputs(), dict(sparse_mode=6, prefix=prefix), how)


def test_prefix_in_range():
    good(inputs(), dict(sparse_mode=6, prefix=[1, 5]))


# the other entry points ------------------------------------------------------------------

def test_attention_scores_validates():
    bad("sparse_mode", inputs(), dict(sparse_mode=9), fn=jr.attention_scores)
    bad("atten_mask", inputs(), dict(sparse_mode=1), fn=jr.attention_scores)
    bad("input_layout", inputs(), dict(input_layout="XYZ"), fn=jr.attention_scores)
    bad("head_num", inputs("BSH"), dict(input_layout="BSH"), fn=jr.attention_scores)


def test_sparse_mask_validates():
    for match, args, kw in [
            ("sparse_mode", (9, 4, 4), {}),
            ("atten_mask", (1, 4, 4), {}),
            ("prefix", (6, 4, 4), {}),
            ("atten_mask", (0, 4, 4), dict(atten_mask=np.zeros((4, 5), bool))),
            (TOKENS, (4, 4, 4), dict(pre_tokens=-1, next_tokens=-1)),
            ("sparse_mode|actual_seq|TND", (7, 4, 4), dict(pre_tokens=4, next_tokens=0)),
            ("actual_seq", (3, None, None), dict(actual_seq_qlen=[2, 4],
                                                 actual_seq_kvlen=[4]))]:
        with pytest.raises(ERR, match=match):
            jr.sparse_mask(*args, **kw)
