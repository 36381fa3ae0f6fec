"""The jnp fallback in query-row chunks (jax_rope/attention/row_chunks.py, GRID_CHUNK_BYTES):
long calls go through their query rows a chunk at a time, the last chunk padded. Here the
chunk is cut down to a few rows so that small cases take that path, against the float64
oracle: each kind of sparse-mode rule in a padded layout and in TND, the other layouts, GQA,
each bias form (a full bias tensor is sliced with the rows), dropout by key and by a
caller's mask (the keep bits hash the global row), masked NaN without influence; and the
compiled fallback's memory at a long sequence, with the real chunk size, and under GQA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypothesis import assume, given
from hypothesis import strategies as st

import attention_oracle as ao
import bias_dropout_oracle as bo
import jax_rope as jr
from jax_rope.attention import ops, row_chunks
from test_attention_bias import check_case, compare, lib_run, padded_case, ref_run, tnd_case
from test_attention_dropout import drop_case, words
from test_flash_attention import run_case
from test_flash_attention_grad import check_grads_vs_refs
from test_masked_positions import check_no_influence, normal


def rng_for(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


@pytest.fixture
def chunk_rows(monkeypatch):
    """chunk_rows(rows, args, kw): the fallback's chunks hold `rows` query rows of the case
    (its score grid is B x N1 x rows x Skv); jitted programs of other chunk sizes are
    dropped before and after."""
    def set_rows(rows, args, kw):
        batch, heads, _, kv_len = bo.Geometry(*args[:2], **kw).grid
        monkeypatch.setattr(row_chunks, "GRID_CHUNK_BYTES", rows * batch * heads * kv_len * 4)
        jax.clear_caches()

    with jr.backend("fallback"):
        yield set_rows
    jax.clear_caches()


def check_forward_and_grads(args, kw, rng):
    run_case(args, kw, jit=True)
    check_grads_vs_refs(args, kw, rng, dense=False)


# The modes' tables reach the chunks through one function (masks.visible_columns); the
# cases take each kind of row rule once: element mask with and without a band, causal with
# rows that see no key, band, prefix; in TND also the mode 7/8 bands and a sequence's mask.
@pytest.mark.parametrize("mode", [0, 1, 3, 4, 5])
def test_padded_modes(chunk_rows, mode):
    """B2 Sq7 Skv5 GQA 4 on 2 in chunks of 3 rows (the last padded by 2)."""
    rng = rng_for("chunks-padded", mode)
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=7, Skv=5, N1=4, N2=2, D=8,
                            **ao.mode_kwargs(mode, rng, 2, 7, 5, 4))
    chunk_rows(3, args, kw)
    check_forward_and_grads(args, kw, rng)


@pytest.mark.parametrize("mode", [1, 2, 6, 7, 8])
def test_tnd_modes(chunk_rows, mode):
    """Packed tokens with an empty sequence, in chunks of 3 tokens that cut across sequences."""
    rng = rng_for("chunks-tnd", mode)
    lq, lkv = [2, 0, 3, 3], [3, 0, 4, 4]
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    chunk_rows(3, args, kw)
    check_forward_and_grads(args, kw, rng)


@pytest.mark.parametrize("layout,rows", [("BNSD", 1), ("SBH", 4), ("BSH", 5)])
def test_other_layouts(chunk_rows, layout, rows):
    rng = rng_for("chunks-layout", layout, rows)
    args, kw = ao.make_case(rng, layout, B=2, Sq=6, Skv=9, N1=4, N2=2, D=8, Dv=4,
                            sparse_mode=4, pre_tokens=2, next_tokens=1)
    chunk_rows(rows, args, kw)
    check_forward_and_grads(args, kw, rng)


@pytest.mark.parametrize("layout,pse_type,form,batch_one,mode", [
    ("BSND", 1, "full", False, 3),  # a bias of Sq rows: sliced with each chunk
    ("BSND", 0, "full", False, 4),  # ... and with each chunk's key window (band: not at 0)
    ("BNSD", 0, "row", True, 0),
    ("SBH", 2, "slopes", False, 4),
    ("BSH", 3, "slopes", True, 6),
])
def test_padded_bias(chunk_rows, layout, pse_type, form, batch_one, mode):
    """Forward, scores, dq/dk/dv/dpse (Sq=5 in chunks of 2)."""
    rng = rng_for("chunks-bias", layout, pse_type, form, mode)
    args, kw, pse = padded_case(rng, layout, pse_type, form, batch_one, mode, offsets=(2, 0))
    chunk_rows(2, args, kw)
    check_case(args, kw, pse, rng)


@pytest.mark.parametrize("pse_type,form,batch_one,mode", [
    (1, "packed_full", False, 8), (0, "compressed", True, 3), (2, "slopes", True, 3),
    (0, "packed_row", False, 4)])
def test_tnd_bias(chunk_rows, pse_type, form, batch_one, mode):
    rng = rng_for("chunks-tnd-bias", pse_type, form, mode)
    args, kw, pse = tnd_case(rng, pse_type, form, batch_one, mode, offsets=(0, 3))
    chunk_rows(2, args, kw)
    check_case(args, kw, pse, rng)


@pytest.mark.parametrize("name,by", [("bnsd-3-full", "key"), ("bsnd-0", "key"),
                                     ("tnd-8-sqrt", "mask"),
                                     ("tnd-2-packed", "key"), ("sbh-4-alibi", "mask")])
def test_dropout(chunk_rows, name, by):
    """The keep bits of each chunk's rows: by the key's hash of the global row, or read from a
    caller's packed mask (random bits here) at the row's bit offset."""
    rng = rng_for("chunks-drop", name, by)
    args, kw, pse = drop_case(name, rng)
    geom = bo.Geometry(*args[:2], **kw)
    if by == "key":
        given = {"dropout_key": jax.random.key(int(rng.integers(0, 2 ** 31)))}
        keep = bo.keep_grid(words(given["dropout_key"]), kw["keep_prob"], geom)
    else:
        numel = geom.n1 * sum(s[4] * s[5] for s in geom.segments)
        bits = rng.random(numel) < kw["keep_prob"]
        given = {"dropout_mask": bo.pack_bits(bits)}
        keep = bo.keep_grid_from_bits(bits, geom)
    dout = rng.standard_normal(ref_run(args, kw, pse=pse)["out"].shape).astype(np.float32)
    ref = ref_run(args, kw, pse=pse, dout=dout, keep=keep)
    chunk_rows(2, args, kw)
    got = lib_run(args, kw, pse=pse, dout=dout, scores=False, **given)
    compare(got, ref, args, kw, pse=pse, what=f"{name} by {by}")


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_masked_nan_has_no_influence(chunk_rows, layout):
    """NaN and Inf in key/value rows that masked positions hold change no output or gradient
    element of a query row that does not see them (chunks of 7 rows)."""
    if layout == "BSND":
        mode, kw = 4, dict(pre_tokens=20, next_tokens=3)
        q, k, v = normal((1, 40, 2, 16), 0), normal((1, 40, 1, 16), 1), normal((1, 40, 1, 16), 2)
        visible = ~np.asarray(jr.sparse_mask(mode, 40, 40, **kw))[0]
        rows, axis = [10, 30], 1
    else:
        mode, kw = 8, dict(pre_tokens=20, next_tokens=2, actual_seq_qlen=[12, 40],
                           actual_seq_kvlen=[14, 44])
        q, k, v = normal((40, 2, 16), 0), normal((44, 1, 16), 1), normal((44, 1, 16), 2)
        visible = ~np.asarray(jr.sparse_mask(mode, 40, 44, **kw))
        kw["input_layout"] = "TND"
        rows, axis = [20], 0
    kw["sparse_mode"] = mode
    call = lambda q, k, v: jr.flash_attention_score(q, k, v, **kw)[0]
    chunk_rows(7, (np.asarray(q), np.asarray(k)), kw)
    blind = check_no_influence("fallback", call, q, k, v, visible, axis, rows,
                               [("value", np.nan), ("key", np.nan), ("value", np.inf)])
    assert blind.any() and (~blind).any()


def test_long_call_memory_is_bounded():
    """A causal B1 S4096 N8 D64 forward, its gradient, and the gradient of ALiBi slopes (dpse,
    computed from the saved statistics on every platform) on the fallback: dense, one score
    grid alone would take 512 MiB (and the programs hold several); in chunks the compiled
    programs' temporaries stay within a few chunks."""
    q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
    slopes = jax.ShapeDtypeStruct((8,), jnp.float32)
    attend = lambda q, k, v, s: jr.flash_attention_score(q, k, v, sparse_mode=2, pse=s,
                                                         pse_type=2)[0]
    loss = lambda q, k, v, s: jnp.sum(attend(q, k, v, s))
    with jr.backend("fallback"):
        for f in (attend, jax.grad(loss, (0, 1, 2)), jax.grad(loss, 3)):
            compiled = jax.jit(f).lower(q, q, q, slopes).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            assert temp < 6 * row_chunks.GRID_CHUNK_BYTES <= 512 << 20, temp


def test_grouped_query_heads_share_their_key_and_value():
    """GQA decode, B2 Sq1 Skv8192 N32 on 4 key/value heads, on the fallback: the forward and
    gradient programs hold less than one copy of the key repeated for every query head
    (256 MiB in float32), which reading key and value per group never makes."""
    q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.float32)
    k = jax.ShapeDtypeStruct((2, 8192, 4, 128), jnp.float32)
    repeated = 2 * 8192 * 32 * 128 * 4
    attend = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=3)[0]
    loss = lambda q, k, v: jnp.sum(attend(q, k, v))
    with jr.backend("fallback"):
        for f in (attend, jax.grad(loss, (0, 1, 2))):
            compiled = jax.jit(f).lower(q, k, k).compile()
            assert compiled.memory_analysis().temp_size_in_bytes < repeated


def chunk_windows(mode, q_len, kv_len, grids, **kw):
    """The fallback's chunks and key windows for a BSND call of `mode` with `grids` (B x N1)
    score grids of q_len x kv_len."""
    q, k = jnp.zeros((1, q_len, 1, 8)), jnp.zeros((1, kv_len, 1, 8))
    call = ops.prepare(q, k, k, input_layout="BSND", head_num=None, scale=None,
                       sparse_mode=mode, prefix=None, actual_seq_qlen=None,
                       actual_seq_kvlen=None, **{"atten_mask": None, "pre_tokens": ao.INT_MAX,
                                                 "next_tokens": ao.INT_MAX, **kw})
    return row_chunks.chunk_windows(call.options, q_len, kv_len, grids)


@given(mode=st.sampled_from([0, 1, 2, 3, 4]), q_len=st.integers(1, 300),
       kv_len=st.integers(1, 300), band=st.tuples(st.integers(-300, 300), st.integers(-300, 300)),
       grids=st.integers(1, 1 << 16))
def test_key_windows_hold_every_visible_key(mode, q_len, kv_len, band, grids):
    """Every (row, key) pair that the oracle's mask shows lies in the window of the row's
    chunk; the chunks cover the rows, at most WINDOW_WIDTHS widths whose chunks together
    hold no more scores than plain chunks may, windows inside the keys.
    (Modes 5-8 and TND keep every column: their bands may be traced.)"""
    kw = {}
    if mode in (0, 4):
        assume(ao.band_valid(*ao.to_top_left(mode, *band, q_len, kv_len), q_len, kv_len))
        kw.update(pre_tokens=band[0], next_tokens=band[1])
    if mode in (0, 1):  # an element mask of zeros: mode 0's band then applies
        kw["atten_mask"] = np.zeros((q_len, kv_len), bool)
    windows = chunk_windows(mode, q_len, kv_len, grids, **kw)
    size, count = windows.size, windows.count
    plain_rows = max(1, min(q_len, row_chunks.GRID_CHUNK_BYTES // (grids * kv_len * 4)))
    budget = max(row_chunks.GRID_CHUNK_BYTES, plain_rows * grids * kv_len * 4)
    assert windows.held * grids * 4 <= budget
    assert (count - 1) * size < q_len <= count * size
    assert len(windows.runs) <= row_chunks.WINDOW_WIDTHS
    assert [r[0] for r in windows.runs] == [0] + [r[1] for r in windows.runs[:-1]]
    assert windows.runs[-1][1] == count
    visible = ~ao.dense_mask(mode, q_len, kv_len, kw.get("pre_tokens", ao.INT_MAX),
                             kw.get("next_tokens", ao.INT_MAX), atten_mask=kw.get("atten_mask"))
    visible = visible.reshape(q_len, kv_len)
    for start, stop, width in windows.runs:
        for c in range(start, stop):
            first = windows.firsts[c]
            assert 0 <= first and first + width <= kv_len
            _, cols = np.nonzero(visible[c * size:(c + 1) * size])
            assert ((cols >= first) & (cols < first + width)).all(), (c, first, width)


def test_key_windows_skip_what_bands_hide():
    """A causal S1024 call computes 5/8 of the score grid (four widths), a band of 1024 keys
    over S8192 under a fifth, an unmasked call and a chunked prefill (Sq256 over Skv8192:
    windows would leave out 1%) all of it."""
    causal = chunk_windows(2, 1024, 1024, 8)
    assert len(causal.runs) == 4 and causal.scores == 0.625 * 1024 * 1024
    band = chunk_windows(4, 8192, 8192, 8, pre_tokens=1024, next_tokens=0)
    assert band.scores <= 0.2 * 8192 * 8192
    for w in (chunk_windows(0, 1024, 1024, 8), chunk_windows(3, 256, 8192, 32)):
        assert w.scores == w.count * w.size * w.runs[0][2] and w.firsts == [0] * w.count
