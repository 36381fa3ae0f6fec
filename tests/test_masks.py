"""jr.sparse_mask against the NumPy oracle (spec/attention.md, sparse_mode table): every mode,
Sq != Skv, negative tokens, prefix, atten_mask shapes and dtypes, varlen with empty sequences,
and the mode 7/8 worked examples (device pieces stitched back equal the uncut mask)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attention_oracle as ao
import jax_rope as jr

N_EXAMPLES = max(3, settings.default.max_examples // 3)
SHAPES = [(4, 4), (3, 6), (6, 3)]


def check(mode, q_len, kv_len, **kw):
    got = np.asarray(jr.sparse_mask(mode, q_len, kv_len, **kw))
    exp = ao.sparse_mask(mode, q_len, kv_len, **kw)
    assert got.dtype == np.bool_, got.dtype
    assert got.shape == exp.shape, (got.shape, exp.shape)
    if not np.array_equal(got, exp):
        bad = np.argwhere(got != exp)
        raise AssertionError(f"mode {mode} {kw}: {len(bad)} positions differ, first "
                             f"{tuple(bad[0])}: got {got[tuple(bad[0])]}\n"
                             f"got:\n{got.astype(int)}\nexpected:\n{exp.astype(int)}")
    return got


def prefix_mask(sq, skv, prefix):
    """The mode 5 atten_mask the caller must pass: exactly the prefix geometry, (B,1,Sq,Skv)."""
    return ao.dense_mask(6, sq, skv, prefix=prefix)


def valid_prefix(rng, b, sq, skv):
    return [int(x) for x in rng.integers(max(skv - sq, 0), skv + 1, size=b)]


@pytest.mark.parametrize("sq,skv", SHAPES)
@pytest.mark.parametrize("mode", [2, 3])
def test_causal(mode, sq, skv):
    m = check(mode, sq, skv)
    assert m.shape == (1, sq, skv)


@pytest.mark.parametrize("sq,skv", SHAPES)
def test_mode0_without_mask_masks_nothing(sq, skv):
    m = check(0, sq, skv, pre_tokens=1, next_tokens=0)
    assert not m.any()


@pytest.mark.parametrize("mshape,dtype", [("2d", bool), ("1111", np.uint8), ("B1", bool)])
@pytest.mark.parametrize("sq,skv", SHAPES)
def test_mode0_mask_and_band(sq, skv, mshape, dtype):
    rng = np.random.default_rng([sq, skv, len(mshape)])
    shape = {"2d": (sq, skv), "1111": (1, 1, sq, skv), "B1": (3, 1, sq, skv)}[mshape]
    am = ao.random_atten_mask(rng, shape, 0.2, dtype)
    m = check(0, sq, skv, atten_mask=am)
    assert m.shape[0] == (3 if mshape == "B1" else 1)
    check(0, sq, skv, atten_mask=am, pre_tokens=1, next_tokens=1)
    check(0, sq, skv, atten_mask=am, pre_tokens=2, next_tokens=0)


@pytest.mark.parametrize("sq,skv", SHAPES)
def test_mode1_is_the_mask(sq, skv):
    rng = np.random.default_rng([1, sq, skv])
    am = ao.random_atten_mask(rng, (2, 1, sq, skv), 0.4, np.uint8)
    m = check(1, sq, skv, atten_mask=am, pre_tokens=0, next_tokens=0)
    np.testing.assert_array_equal(m, am[:, 0] != 0)


@pytest.mark.parametrize("pre,nxt", [(1, 0), (0, 0), (2, 1), (ao.INT_MAX, 0), (0, ao.INT_MAX),
                                     (3, -1), (-1, 2)])
@pytest.mark.parametrize("sq,skv", SHAPES)
def test_mode4_band(sq, skv, pre, nxt):
    if not ao.band_valid(*ao.to_top_left(4, pre, nxt, sq, skv), sq, skv):
        pytest.skip("band not valid for this shape (covered by the validation tests)")
    check(4, sq, skv, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("pre,nxt", [(2, -1), (-1, 2), (3, -2), (-2, 3)])
def test_negative_tokens(pre, nxt):
    """Negative pre/next in mode 4 (bottom-right origin) and mode 0 (top-left, with a mask)."""
    check(4, 5, 5, pre_tokens=pre, next_tokens=nxt)
    check(0, 5, 5, pre_tokens=pre, next_tokens=nxt, atten_mask=np.zeros((5, 5), bool))
    # Sq=3, Skv=6: pre' = pre - 3, next' = next + 3
    if ao.band_valid(*ao.to_top_left(4, pre, nxt, 3, 6), 3, 6):
        check(4, 3, 6, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("sq,skv", SHAPES)
@pytest.mark.parametrize("mode", [5, 6])
def test_prefix(mode, sq, skv):
    rng = np.random.default_rng([mode, sq, skv])
    for prefix in (valid_prefix(rng, 3, sq, skv), np.asarray([skv, max(skv - sq, 0)])):
        kw = dict(prefix=prefix)
        if mode == 5:
            kw["atten_mask"] = prefix_mask(sq, skv, prefix)
        m = check(mode, sq, skv, **kw)
        assert m.shape[0] == len(prefix)
        # prefix columns are never masked
        for b, p in enumerate(prefix):
            assert not m[b, :, :p].any()


@pytest.mark.parametrize("mode", [2, 3, 4, 6])
def test_compressed_mask_is_ignored(mode):
    """A given compressed mask does not change the geometry (it comes from the mode)."""
    kw = dict(pre_tokens=2, next_tokens=1) if mode == 4 else {}
    if mode == 6:
        kw["prefix"] = [3, 4]
    base = check(mode, 3, 5, **kw)
    got = np.asarray(jr.sparse_mask(mode, 3, 5, atten_mask=ao.compressed_mask(mode), **kw))
    np.testing.assert_array_equal(got, base)


# varlen ---------------------------------------------------------------------------------

VARLEN = [([2, 0, 3, 1], [2, 0, 4, 3]), ([3, 2], [1, 4]), ([0, 2, 2, 0], [0, 3, 2, 0])]


@pytest.mark.parametrize("lens", VARLEN, ids=str)
@pytest.mark.parametrize("mode", [0, 2, 3, 4, 6])
def test_varlen(mode, lens):
    lq, lkv = lens
    kw = dict(actual_seq_qlen=ao.cumulative(lq), actual_seq_kvlen=ao.cumulative(lkv))
    if mode == 4:
        kw.update(pre_tokens=4, next_tokens=4)
    if mode == 6:
        kw["prefix"] = [min(b, max(b - a, 0) + 1) for a, b in zip(lq, lkv)]
    m = check(mode, None, None, **kw)
    assert m.shape == (sum(lq), sum(lkv))
    if lens != VARLEN[0]:
        return
    # same with explicit token counts, numpy arrays and tuples as lengths
    kw2 = dict(kw, actual_seq_qlen=np.asarray(kw["actual_seq_qlen"], np.int32),
               actual_seq_kvlen=tuple(kw["actual_seq_kvlen"]))
    np.testing.assert_array_equal(np.asarray(jr.sparse_mask(mode, sum(lq), sum(lkv), **kw2)), m)


@pytest.mark.parametrize("lens", VARLEN[:2], ids=str)
@pytest.mark.parametrize("mode", [0, 1])
def test_varlen_atten_mask_window(mode, lens):
    """TND atten_mask is (maxSq, maxSkv); each sequence uses its top-left window."""
    lq, lkv = lens
    rng = np.random.default_rng([mode, len(lq)])
    am = ao.random_atten_mask(rng, (max(lq), max(lkv)), 0.3)
    kw = dict(actual_seq_qlen=ao.cumulative(lq), actual_seq_kvlen=ao.cumulative(lkv),
              atten_mask=am)
    check(mode, None, None, **kw)
    if mode == 0:
        check(mode, None, None, pre_tokens=1, next_tokens=1, **kw)


@pytest.mark.parametrize("mode", [7, 8])
def test_varlen_split_modes_with_empty_sequences(mode):
    """Modes 7/8 pick the last/first NON-EMPTY sequence for the band."""
    lq, lkv = [0, 2, 3, 2, 0], [0, 3, 4, 5, 0]
    if mode == 7:  # last non-empty: Sq 2, Skv 5
        tok = dict(pre_tokens=5, next_tokens=-1)
    else:  # first non-empty: Sq 2, Skv 3
        tok = dict(pre_tokens=3, next_tokens=0)
    check(mode, None, None, actual_seq_qlen=ao.cumulative(lq),
          actual_seq_kvlen=ao.cumulative(lkv), **tok)


def _dev(cfg):
    c = dict(cfg)
    mode = c.pop("sparse_mode")
    return check(mode, None, None, **c)


def test_mode7_worked_example():
    """4x6 rightDownCausal cut 2+2 by rows: device 1 mode 7, device 2 mode 3."""
    d1 = _dev(dict(sparse_mode=7, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9],
                   pre_tokens=6, next_tokens=-2))
    d2 = _dev(dict(sparse_mode=3, actual_seq_qlen=[2, 7, 11], actual_seq_kvlen=[6, 11, 15]))
    uncut = np.asarray(jr.sparse_mask(3, 4, 6))[0]
    np.testing.assert_array_equal(uncut, ao.seq_mask(3, 4, 6))
    np.testing.assert_array_equal(np.concatenate([d1[3:5, 3:9], d2[0:2, 0:6]]), uncut)


def test_mode8_worked_example():
    """5x4 leftUpCausal cut 2+3: device 1 mode 2, device 2 mode 8."""
    d1 = _dev(dict(sparse_mode=2, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 7]))
    d2 = _dev(dict(sparse_mode=8, actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13],
                   pre_tokens=4, next_tokens=1))
    uncut = np.asarray(jr.sparse_mask(2, 5, 4))[0]
    np.testing.assert_array_equal(uncut, ao.seq_mask(2, 5, 4))
    np.testing.assert_array_equal(np.concatenate([d1[3:5, 3:7], d2[0:3, 0:4]]), uncut)


# property ---------------------------------------------------------------------------------

@st.composite
def mask_case(draw):
    mode = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6]))
    sq, skv = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kw = {}
    if mode in (0, 4):
        pre = draw(st.integers(-7, 9))
        nxt = draw(st.integers(-7, 9))
        if not ao.band_valid(*ao.to_top_left(mode, pre, nxt, sq, skv), sq, skv):
            pre, nxt = ao.INT_MAX, ao.INT_MAX
        kw.update(pre_tokens=pre, next_tokens=nxt)
    if mode in (0, 1):
        kw["atten_mask"] = ao.random_atten_mask(rng, (sq, skv), 0.3)
    if mode in (5, 6):
        kw["prefix"] = valid_prefix(rng, draw(st.integers(1, 3)), sq, skv)
        if mode == 5:
            kw["atten_mask"] = prefix_mask(sq, skv, kw["prefix"])
    return mode, sq, skv, kw


@settings(max_examples=N_EXAMPLES * 2)
@given(mask_case())
def test_property_dense(case):
    mode, sq, skv, kw = case
    check(mode, sq, skv, **kw)


@st.composite
def varlen_case(draw):
    mode = draw(st.sampled_from([2, 3, 7, 8]))
    n = draw(st.integers(1, 4))
    lq = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    lkv = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    # an empty sequence here is empty on both sides
    lq = [a if b else 0 for a, b in zip(lq, lkv)]
    lkv = [b if a else 0 for a, b in zip(lq, lkv)]
    kw = dict(actual_seq_qlen=ao.cumulative(lq), actual_seq_kvlen=ao.cumulative(lkv))
    if mode in (7, 8):
        bi = ao.band_sequence(mode, lq, lkv)
        if bi is None:
            mode = 3
        else:
            fq, fkv = lq[bi], lkv[bi]
            pre = fkv + draw(st.integers(0, 3))
            if mode == 7:
                if fq > fkv:
                    mode = 3
                else:
                    kw.update(pre_tokens=pre, next_tokens=draw(st.integers(fq - fkv, 0)))
            else:
                kw.update(pre_tokens=pre, next_tokens=draw(st.integers(fq - fkv, fq + 2)))
    return mode, kw


@settings(max_examples=N_EXAMPLES)
@given(varlen_case())
def test_property_varlen(case):
    mode, kw = case
    check(mode, None, None, **kw)


def test_readme_pictures_are_the_generated_ones():
    import pathlib

    from jax_rope.attention import mask_pictures
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert mask_pictures.render() in readme
