"""Attention checks of contract_checks.py: jr.flash_attention_score and its
jax.grad through the NPU lowering, the NPU handlers' host twins, the launch glue
and the simulated aclnnFlashAttentionScore family (tests/npu_sim/attention.cc),
compared with the float64 NumPy oracle of attention.md. The NPU kernel is
expected on Atlas A2/A3 only (the operator's product table); elsewhere the
same calls must take the fallback and give the same numbers."""

import contextlib
import ctypes
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attention_oracle as ref
import jax_rope as jr
from jax_rope import npu
from jax_rope.attention import row_chunks
from sim_libraries import CHIP, CORE, GEN, OPS

KERNEL = CHIP in ("A2", "A3")
ATTENTION_CHECKS = {}
CORE.jax_rope_sim_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int32]
FWD, BWD = npu.ATTENTION_FWD, npu.ATTENTION_BWD


def check(fn):
    ATTENTION_CHECKS[fn.__name__] = fn
    return fn


def normal(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def attention_case(shapes, tol=2e-5, dtype=jnp.float32, want_kernel=KERNEL, **kw):
    """Forward (out and the statistics) and jax.grad wrt q, k, v against the oracle (on
    the inputs as rounded to `dtype`); want_kernel: whether the NPU kernel runs them."""
    q, k, v = (normal(s, i, dtype) for i, s in enumerate(shapes))
    fwd = jax.jit(lambda q, k, v: jr.flash_attention_score(q, k, v, **kw))
    text = fwd.lower(q, k, v).as_text()
    assert (FWD in text) == want_kernel, "the forward is not " + (
        "the NPU kernel" if want_kernel else "the fallback")
    ref_kw = ref.ref_kwargs(kw)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    for got, want in zip(fwd(q, k, v), ref.flash_attention_score(*f64, **ref_kw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    dout = normal(ref.flash_attention_score(*f64, **ref_kw)[0].shape, 9)
    loss = lambda q, k, v: jnp.sum(
        jr.flash_attention_score(q, k, v, **kw)[0].astype(jnp.float32) * dout)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert (BWD in grad.lower(q, k, v).as_text()) == want_kernel, "the backward's path"
    want = ref.flash_attention_grad(*f64, np.asarray(dout, np.float64), **ref_kw)
    for got, w in zip(grad(q, k, v), want):
        np.testing.assert_allclose(np.asarray(got, np.float64), w, rtol=tol, atol=tol)
    assert CORE.jax_rope_sim_live_tensors() == 0, "descriptors left alive"
    assert CORE.jax_rope_sim_live_executors() == 0, "executors left alive"


def tnd(q, k, a, b, **kw):
    """flash_attention_score(q, k, k, **kw) in TND with lengths a, b (traced where arrays)."""
    return jr.flash_attention_score(q, k, k, input_layout="TND", actual_seq_qlen=a,
                                    actual_seq_kvlen=b, **kw)


def traced_lengths(q, k, **kw):
    """The jitted TND call flash_attention_score(q, k, k, **kw) with actual_seq_qlen and
    actual_seq_kvlen traced: f(lq, lkv) takes them as Python lists (int32 arrays inside)."""
    f = jax.jit(lambda a, b: tnd(q, k, a, b, **kw))
    return lambda lq, lkv: f(jnp.asarray(lq, jnp.int32), jnp.asarray(lkv, jnp.int32))


def traced_cases(q, k, lengths, tol=2e-5, **kw):
    """The TND call (q, k, k) with traced lengths, for each (lq, lkv) of `lengths`: its
    forward and jax.grad wrt q and k (key and value both) against the oracle. Returns the
    jitted forward, f(lq, lkv)."""
    fwd = traced_lengths(q, k, **kw)
    grad = jax.jit(jax.grad(lambda q, k, a, b, dout: jnp.sum(tnd(q, k, a, b, **kw)[0] * dout),
                            (0, 1)))
    f64 = [np.asarray(x, np.float64) for x in (q, k, k)]
    for lq, lkv in lengths:
        ref_kw = ref.ref_kwargs(dict(kw, input_layout="TND", actual_seq_qlen=lq,
                                     actual_seq_kvlen=lkv))
        want = ref.flash_attention_score(*f64, **ref_kw)
        for got, w in zip(fwd(lq, lkv), want):
            np.testing.assert_allclose(np.asarray(got, np.float64), w, rtol=tol, atol=tol)
        dout = normal(want[0].shape, 9)
        dq, dk, dv = ref.flash_attention_grad(*f64, np.asarray(dout, np.float64), **ref_kw)
        got = grad(q, k, jnp.asarray(lq, jnp.int32), jnp.asarray(lkv, jnp.int32), dout)
        for g, w in zip(got, (dq, dk + dv)):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)
    return fwd


@contextlib.contextmanager
def fallback_chunks(score_bytes):
    """The fallback goes through its query rows in chunks of `score_bytes` of scores (as
    long calls do at row_chunks.GRID_CHUNK_BYTES); programs traced before or inside are
    dropped."""
    kept = row_chunks.GRID_CHUNK_BYTES
    row_chunks.GRID_CHUNK_BYTES = score_bytes
    jax.clear_caches()
    try:
        yield
    finally:
        row_chunks.GRID_CHUNK_BYTES = kept
        jax.clear_caches()


def reads_the_sequence_table(call) -> bool:
    """Whether `call` runs the NPU handler of a TND call: it fails when the handler's
    aclrtMallocHost for the sequence table fails."""
    CORE.jax_rope_sim_fail_next(b"aclrtMallocHost", 207001)
    try:
        jax.block_until_ready(call())
    except Exception as e:  # noqa: BLE001
        assert "injected failure of aclrtMallocHost" in str(e), e
        return True
    finally:
        CORE.jax_rope_sim_fail_next(None, 0)
    return False


def bsnd(b, sq, skv, n1, n2, d, dv=None):
    return [(b, sq, n1, d), (b, skv, n2, d), (b, skv, n2, dv or d)]


@check
def attention_mode0_no_mask():
    attention_case(bsnd(2, 5, 7, 4, 2, 16))


@check
def w6_mode0_mask_and_band():
    # The NPU applies only the mask in mode 0; the band must reach it inside the mask.
    mask = np.random.default_rng(3).random((2, 1, 5, 7)) < 0.3
    attention_case(bsnd(2, 5, 7, 4, 2, 16), atten_mask=jnp.asarray(mask), pre_tokens=3,
                   next_tokens=2)


@check
def w7_rows_masked_by_the_user_mask():
    # Fully masked rows (mode 0 without a band, and mode 1): 0 / -FLT_MAX / FLT_MAX
    # only in the operator's invalid-line mode (innerPrecise=2).
    mask = np.random.default_rng(4).random((2, 1, 5, 7)) < 0.3
    mask[0, 0, 1] = mask[1, 0, 4] = True
    for mode in (0, 1):
        attention_case(bsnd(2, 5, 7, 4, 2, 16), atten_mask=jnp.asarray(mask), sparse_mode=mode)


@check
def w8_prefix_mode_with_a_shared_mask():
    # Mode 5, B = 2, one (1, 1, S, S) mask: the operator takes only B1SS/BNSS there.
    # (attention.md: the mask must hold exactly the prefix pattern, so one shared
    # mask means one prefix for every batch.)
    mask = ref.dense_mask(6, 6, 6, prefix=[3, 3])[:1]
    assert mask.shape[:2] == (1, 1), mask.shape
    attention_case(bsnd(2, 6, 6, 2, 2, 16), atten_mask=jnp.asarray(mask), sparse_mode=5,
                   prefix=[3, 3])


@check
def w5_tnd_statistics_with_several_heads():
    # VarLen writes softmax max/sum in NTD order; the spec's (Tq, N1) must come back.
    attention_case([(10, 3, 16), (12, 3, 16), (12, 3, 16)], input_layout="TND", sparse_mode=0,
                   actual_seq_qlen=[4, 10], actual_seq_kvlen=[5, 12], pre_tokens=2,
                   next_tokens=1)


@check
def w9_host_lists_read_through_pinned_memory():
    # Prefix lengths (and TND's cumulative lengths) are copied to the host; on CANN
    # 8.0 an asynchronous copy into pageable memory is undefined (corrupted here).
    attention_case(bsnd(2, 6, 8, 2, 2, 16), sparse_mode=6, prefix=[3, 5])


@check
def attention_mode2_bnsd_value_dim():
    attention_case([(2, 4, 6, 16), (2, 2, 6, 16), (2, 2, 6, 8)], input_layout="BNSD",
                   sparse_mode=2)


@check
def attention_16_bit_dtypes():
    # bfloat16 and float16 through the glue (ACL_BF16 / ACL_FLOAT16): out and the
    # gradients in the input dtype, the statistics in float32, P rounded for the
    # matrix unit; a causal band and GQA.
    for dtype in (jnp.bfloat16, jnp.float16):
        attention_case(bsnd(2, 70, 70, 4, 2, 32), tol=2e-2, dtype=dtype, sparse_mode=2)
        attention_case([(2, 4, 9, 32), (2, 2, 12, 32), (2, 2, 12, 16)], tol=2e-2, dtype=dtype,
                       input_layout="BNSD", sparse_mode=3)


@check
def attention_mode3_sbh():
    attention_case([(7, 2, 4 * 16), (9, 2, 2 * 16), (9, 2, 2 * 16)], input_layout="SBH",
                   head_num=4, sparse_mode=3)


@check
def attention_mode4_band():
    attention_case(bsnd(2, 6, 8, 2, 1, 16), sparse_mode=4, pre_tokens=3, next_tokens=1)


@check
def attention_tnd_varlen_mode3():
    # lengths q [3, 2, 0, 4], kv [4, 3, 0, 5]: an empty sequence and Skv > Sq
    attention_case([(9, 4, 16), (12, 2, 16), (12, 2, 16)], input_layout="TND", sparse_mode=3,
                   actual_seq_qlen=[3, 5, 5, 9], actual_seq_kvlen=[4, 7, 7, 12])


@check
def attention_tnd_tokens_after_the_last_sequence():
    # Query and key hold tokens after the last cumulative ends (the spec allows it: rows that
    # see no key, keys no row sees). The operators get the sequences' tokens only (CANN 8.0
    # refuses T beyond the last end); the rest give out 0, the dead-row statistics and zero
    # gradients. Traced lengths too, and lengths with no query token at all.
    tnd = dict(input_layout="TND")
    attention_case([(9, 4, 16), (12, 2, 16), (12, 2, 16)], sparse_mode=2,
                   actual_seq_qlen=[3, 7], actual_seq_kvlen=[4, 9], **tnd)
    attention_case([(9, 4, 16), (12, 2, 16), (12, 2, 16)], sparse_mode=3,
                   actual_seq_qlen=[3, 9], actual_seq_kvlen=[4, 10], **tnd)
    attention_case([(4, 2, 16), (5, 2, 16), (5, 2, 16)], sparse_mode=0,
                   actual_seq_qlen=[0, 0], actual_seq_kvlen=[2, 3], **tnd)
    q, k = normal((9, 4, 16), 0), normal((12, 2, 16), 1)
    f = traced_lengths(q, k, sparse_mode=2)
    for lq, lkv in (([3, 7], [4, 9]), ([2, 9], [5, 12]), ([0, 1], [0, 1]), ([0, 0], [3, 5])):
        want = ref.flash_attention_score(*(np.asarray(x, np.float64) for x in (q, k, k)),
                                         sparse_mode=2, actual_seq_qlen=lq,
                                         actual_seq_kvlen=lkv, **tnd)
        for g, w in zip(f(lq, lkv), want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5)
    assert CORE.jax_rope_sim_live_tensors() == 0, "descriptors left alive"


@check
def attention_tnd_keyless_sequence():
    # A sequence with query tokens and no key (its rows see nothing: out 0, the dead-row
    # statistics). CANN 8.0's VarLen tiling refuses it: concrete lengths take the fallback
    # there, traced ones the fallback when the call runs and the table holds such a
    # sequence (the operator otherwise); with "ffi" the operator's refusal comes back.
    # Later generations take it, except in mode 4 (below).
    shapes = [(7, 2, 16), (4, 2, 16), (4, 2, 16)]
    kw = dict(input_layout="TND", sparse_mode=0, actual_seq_qlen=[2, 7],
              actual_seq_kvlen=[0, 4])
    attention_case(shapes, want_kernel=KERNEL and GEN >= 85, **kw)
    # No key token at all (the operators take T >= 1: not called, every row dead), with
    # concrete lengths and traced ones (the call is not folded away then), forward and
    # backward.
    attention_case(shapes, want_kernel=KERNEL and GEN >= 85, **dict(kw, actual_seq_kvlen=[0, 0]))
    q, k = normal(shapes[0], 0), normal(shapes[1], 1)
    f = traced_cases(q, k, [([2, 7], [0, 0]), ([2, 7], [0, 4]), ([2, 7], [1, 4])])
    # Mode 4 wants its band to meet every sequence's keys ("band场景，preTokens和nextTokens之间
    # 必须要有交集"); the spec skips sequences without keys, so their calls take the fallback
    # on every generation (here sequence 0's band, pre' 4 and next' -2, meets no key).
    band = dict(sparse_mode=4, pre_tokens=2, next_tokens=0)
    attention_case(shapes, want_kernel=False, **dict(kw, **band))
    f_band = traced_cases(q, k, [([2, 7], [0, 4])], **band)
    if not KERNEL:
        return
    assert reads_the_sequence_table(lambda: f([2, 7], [1, 4]))
    assert reads_the_sequence_table(lambda: f([2, 7], [0, 4])) == (GEN >= 85)
    assert reads_the_sequence_table(lambda: f_band([2, 7], [1, 4]))
    assert not reads_the_sequence_table(lambda: f_band([2, 7], [0, 4]))
    if GEN >= 85:
        return
    try:
        with jr.backend("ffi"):  # read when the call is traced
            jax.block_until_ready(traced_lengths(q, k)([2, 7], [0, 4]))
    except Exception as e:  # noqa: BLE001
        assert "seqLen is not 0 and sekvLen is 0" in str(e), e
        assert CORE.jax_rope_sim_live_tensors() == 0
        return
    raise AssertionError("CANN 8.0's VarLen operator accepted a sequence without keys")


def vmapped_tnd_case(q, k, lq, lkv, dout, **kw):
    """vmap over q, k, the lengths (and dout) of TND calls (q, k, k) with traced lengths:
    each copy's forward and jax.grad wrt q and k against the oracle."""
    fn = lambda q, k, a, b: tnd(q, k, a, b, **kw)
    grad = jax.grad(lambda q, k, a, b, d: jnp.sum(tnd(q, k, a, b, **kw)[0] * d), (0, 1))
    for _ in range(q.ndim - 3):
        fn, grad = jax.vmap(fn), jax.vmap(grad)
    fwd = jax.jit(fn)
    lengths = jnp.asarray(lq, jnp.int32), jnp.asarray(lkv, jnp.int32)
    outs, grads = fwd(q, k, *lengths), jax.jit(grad)(q, k, *lengths, dout)
    for c in np.ndindex(q.shape[:-3]):
        f64 = [np.asarray(x[c], np.float64) for x in (q, k, k)]
        ref_kw = dict(kw, input_layout="TND", actual_seq_qlen=list(np.asarray(lq)[c]),
                      actual_seq_kvlen=list(np.asarray(lkv)[c]))
        for got, w in zip(outs, ref.flash_attention_score(*f64, **ref_kw)):
            np.testing.assert_allclose(np.asarray(got[c], np.float64), w, rtol=2e-5, atol=2e-5)
        dq, dk, dv = ref.flash_attention_grad(*f64, np.asarray(dout[c], np.float64), **ref_kw)
        for got, w in zip(grads, (dq, dk + dv)):
            np.testing.assert_allclose(np.asarray(got[c], np.float64), w, rtol=2e-5, atol=2e-5)
    return lambda: fwd(q, k, *lengths)


@check
def attention_vmapped_tnd_calls():
    # vmap folds the copies of a TND call into its token axis, each copy's sequences shifted
    # by the copy's offset. The VarLen operator's cumulative lengths cannot skip the tokens
    # after a copy's last sequence, so the lowering gives it one copy at a time: traced
    # lengths that leave such tokens, forward and backward, a nested vmap, and in mode 3 a
    # copy with Sq_b > Skv_b (the fallback for that copy alone, the operator for the others).
    q, k, dout = normal((3, 9, 4, 16), 0), normal((3, 12, 2, 16), 1), normal((3, 9, 4, 16), 2)
    call = vmapped_tnd_case(q, k, [[3, 7], [2, 9], [4, 5]], [[4, 9], [1, 12], [6, 8]], dout,
                            sparse_mode=3)  # copy 1's sequence 0: Sq 2 > Skv 1
    assert reads_the_sequence_table(call) == KERNEL  # copy 0 reaches the operator
    nested = lambda x: x.reshape((2, 2) + x.shape[1:])
    q, k, dout = normal((4, 6, 2, 16), 3), normal((4, 7, 2, 16), 4), normal((4, 6, 2, 16), 5)
    vmapped_tnd_case(nested(q), nested(k), [[[2, 5], [0, 6]], [[3, 3], [1, 4]]],
                     [[[3, 7], [2, 6]], [[4, 5], [2, 2]]], nested(dout))


@check
def attention_tnd_varlen_mode8_split():
    # attention.md's worked example: device 2 of a 5x4 leftUpCausal sequence cut 2+3
    attention_case([(12, 2, 16), (13, 2, 16), (13, 2, 16)], input_layout="TND", sparse_mode=8,
                   actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13], pre_tokens=4,
                   next_tokens=1)


@check
def attention_invalid_traced_lengths_and_prefix_are_refused():
    # With the host checks off (the NPU fallback has none), the NPU handler refuses what
    # traced values became in the sequence table, naming the argument; the fallback
    # (where no kernel covers the call) computes, which describe() states.
    q = normal((8, 2, 16), 0)
    f = traced_lengths(q, q, sparse_mode=3)
    x = normal((1, 4, 2, 16), 1)
    g = jax.jit(lambda p: jr.flash_attention_score(x, x, x, sparse_mode=6, prefix=p)[0])
    bad = [(lambda: f([4, 12], [4, 8]),
            "actual_seq_qlen/actual_seq_kvlen must be non-decreasing"),
           (lambda: g(jnp.asarray([5], jnp.int32)), "prefix\\[0\\] must be in")]
    with jr.runtime_checks(False):
        for call, message in bad:
            if not KERNEL:
                jax.block_until_ready(call())
                continue
            try:
                jax.block_until_ready(call())
            except Exception as e:  # noqa: BLE001
                assert re.search(message, str(e)), str(e)
                assert CORE.jax_rope_sim_live_tensors() == 0
                continue
            raise AssertionError(f"accepted: {message}")


@check
def attention_handlers_refuse_unknown_attributes():
    # The NPU handlers decode their attributes again: a lowering that sent an unknown code
    # or an out-of-range value gets an FFI error naming it, forward and backward (the
    # bad attributes go to that one's lowering only), and no operator is called.
    from jax_rope.attention import npu_lowering
    forward = lambda q: jr.flash_attention_score(q, q, q, sparse_mode=2)
    backward = jax.grad(lambda q: jnp.sum(forward(q)[0]))
    original = npu_lowering._npu_attributes
    cases = [(change, message, name, fn)
             for change, message in ((dict(layout=np.int32(9)), "unknown layout code 9"),
                                     (dict(sparse_mode=np.int32(11)),
                                      "unknown sparse_mode code 11"),
                                     (dict(pse_type=np.int32(4)), "pse_type 4 without pse"),
                                     (dict(keep_prob=np.float64(1.5)), "keep_prob must be in"))
             for name, fn in (("forward", forward), ("backward", backward))]
    for rows, (change, message, name, fn) in enumerate(cases, 4):
        q = normal((1, rows, 2, 16), rows)  # a shape of its own: nothing lowered is reused

        def attributes(options, change=change, name=name):
            caller = sys._getframe(1).f_code.co_qualname  # npu_forward.<locals>.call
            bad = caller.startswith(f"npu_{name}.")
            return {**original(options), **(change if bad else {})}
        npu_lowering._npu_attributes = attributes
        try:
            jax.block_until_ready(jax.jit(fn)(q))
        except Exception as e:  # noqa: BLE001
            assert re.search(f"NPU attention {name}: {re.escape(message)}", str(e)), str(e)
            assert CORE.jax_rope_sim_live_tensors() == 0
            continue
        finally:
            npu_lowering._npu_attributes = original
        raise AssertionError(f"accepted: {change} ({name})")


@check
def attention_tnd_causal_with_sq_above_skv_takes_the_fallback():
    # The VarLen operator documents "sparse_mode=3 needs Sq <= Skv in every batch" (it has
    # no fully masked rows there); the spec allows it. Concrete lengths that break the rule
    # take the fallback, forward and backward (the spec's answer: the rows that see no key
    # give 0); "ffi" names the gap at trace time. Traced lengths take the fallback when the
    # call runs and the table breaks the rule, the operator otherwise; with "ffi" the NPU
    # handler refuses them, naming the sequence, before the operator is asked.
    shapes = [(7, 2, 16), (8, 2, 16), (8, 2, 16)]
    kw = dict(input_layout="TND", sparse_mode=3, actual_seq_qlen=[2, 7],
              actual_seq_kvlen=[3, 5])  # sequence 1: Sq 5 > Skv 2
    attention_case(shapes, want_kernel=False, **kw)
    q, k = normal(shapes[0], 0), normal(shapes[1], 1)
    # Sq > Skv in sequence 1, in none, in sequence 0
    f = traced_cases(q, k, [([2, 7], lkv) for lkv in ([3, 5], [3, 8], [0, 8])], sparse_mode=3)
    if not KERNEL:
        return
    assert reads_the_sequence_table(lambda: f([2, 7], [3, 8]))
    assert not reads_the_sequence_table(lambda: f([2, 7], [3, 5]))
    # Long calls hold the fallback's scores a chunk of query tokens at a time, also in the
    # branch chosen when the call runs: here chunks of 3 of the 7 tokens (N1 2, Tkv 8), on
    # one generation (the lowering does not depend on it).
    if GEN == 90:
        with fallback_chunks(3 * 2 * 8 * 4):
            g = traced_cases(q, k, [([2, 7], [3, 5])], sparse_mode=3)
            assert not reads_the_sequence_table(lambda: g([2, 7], [3, 5]))
    with jr.backend("ffi"):
        try:
            jr.flash_attention_score(q, k, k, **kw)
        except ValueError as e:
            assert "sparse_mode 3 with TND and a sequence with Sq > Skv" in str(e), e
        else:
            raise AssertionError("backend 'ffi' accepted what no NPU kernel covers")
        try:
            jax.block_until_ready(traced_lengths(q, k, sparse_mode=3)([2, 7], [3, 5]))
        except Exception as e:  # noqa: BLE001
            text = str(e)
            assert "sparse_mode 3 with TND needs Sq <= Skv in every sequence on the NPU " \
                   "(sequence 1: Sq 5, Skv 2)" in text, text
            assert "failed with status" not in text, text  # refused before the operator
            assert CORE.jax_rope_sim_live_tensors() == 0
            return
    raise AssertionError("the NPU handler accepted traced lengths with Sq > Skv")


# --- straight into the simulated operator ------------------------------------------

_P, _D, _I64 = ctypes.c_void_p, ctypes.c_double, ctypes.c_int64
OPS.aclnnFlashAttentionScoreGetWorkspaceSize.argtypes = (
    [_P] * 7 + [_P, _D, _D, _I64, _I64, _I64, ctypes.c_char_p, _I64, _I64] + [_P] * 4 + [_P, _P])
OPS.aclnnFlashAttentionScore.argtypes = [_P, ctypes.c_uint64, _P, _P]


class _Tensors:
    def __init__(self):
        self.keep, self.handles = [], []

    def make(self, shape, dtype=0, itemsize=4):
        n = int(np.prod(shape))
        buf = (ctypes.c_uint8 * max(n * itemsize, 1))()
        dims = (ctypes.c_int64 * len(shape))(*shape)
        strides = (ctypes.c_int64 * len(shape))(*np.cumprod((1,) + shape[:0:-1])[::-1])
        self.keep += [buf, dims, strides]
        h = CORE.aclCreateTensor(dims, len(shape), dtype, strides, 0, 2, dims, len(shape),
                                buf if n else None)
        assert h, "aclCreateTensor failed"
        self.handles.append(h)
        return h

    def destroy(self):
        for h in self.handles:
            assert CORE.aclDestroyTensor(h) == 0


@check
def attention_wrong_calls_directly_are_rejected():
    t = _Tensors()
    q, k, v, out = (t.make((1, 4, 2, 16)) for _ in range(4))
    smax, ssum = t.make((1, 2, 4, 8)), t.make((1, 2, 4, 8))
    empty = t.make((0,))
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()

    def call(layout=b"BSND", sparse=0, softmax_out=empty, stats=smax, mask=None, keep=1.0):
        return OPS.aclnnFlashAttentionScoreGetWorkspaceSize(
            q, k, v, None, None, None, mask, None, 0.25, keep, 2147483647, 2147483647, 2,
            layout, 0, sparse, stats, ssum, softmax_out, out, ctypes.byref(size),
            ctypes.byref(executor))

    def rejected(status, words, **kw):
        assert call(**kw) == status, kw
        message = CORE.aclGetRecentErrMsg().decode()
        assert words in message, message

    rejected(161002, "inputLayout 'BSHD' is not one of", layout=b"BSHD")
    rejected(161002, "inputLayout 'TND' is not one of", layout=b"TND")  # TND is VarLen's
    rejected(161001, "softmaxOutOut is a required output", softmax_out=None)
    rejected(161002, "softmaxMax must be (1, 2, 4, 8)", stats=t.make((1, 2, 4)))
    rejected(161002, "needs the compressed attenMask", sparse=2)
    rejected(161002, "needs the 2048x2048 compressed attenMask", sparse=3,
             mask=t.make((4, 4), dtype=4, itemsize=1))
    rejected(161002, "sparseMode 7", sparse=7)
    rejected(161002, "keepProb < 1 needs dropMaskOptional", keep=0.9)
    # a correct call, launched without the workspace it asked for, then with it
    assert call() == 0 and size.value > 0
    assert OPS.aclnnFlashAttentionScore(None, size.value, executor, None) == 161002
    assert "workspace of" in CORE.aclGetRecentErrMsg().decode()
    work = (ctypes.c_uint8 * size.value)()
    assert OPS.aclnnFlashAttentionScore(work, size.value, executor, None) == 0
    t.destroy()
    assert CORE.jax_rope_sim_live_tensors() == 0
