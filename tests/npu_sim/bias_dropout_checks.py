"""Positional bias and dropout checks of contract_checks.py
(spec/attention_bias_dropout.md, NPU coverage of section 6): jr.flash_attention_score
with pse / pse_type / start offsets / dropout through the NPU lowering, the host
twins, the launch glue (V1 or V2 operators) and the simulated operators
(tests/npu_sim/bias_dropout.h), compared with the jnp fallback (out, statistics,
dq/dk/dv and dpse). The NPU kernel is expected on Atlas A2/A3 where section 6
covers the call; elsewhere the same numbers come from the fallback."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope as jr
from jax_rope import npu
from sim_libraries import CHIP, CORE, OPS

KERNEL = CHIP in ("A2", "A3")
BIAS_DROPOUT_CHECKS = {}
FWD, BWD = npu.ATTENTION_FWD, npu.ATTENTION_BWD
CORE.jax_rope_sim_last_drop_mask.restype = ctypes.c_int64
CORE.jax_rope_sim_last_drop_mask.argtypes = [ctypes.c_void_p, ctypes.c_int64]


def check(fn):
    BIAS_DROPOUT_CHECKS[fn.__name__] = fn
    return fn


def normal(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def assert_clean():
    assert CORE.jax_rope_sim_live_tensors() == 0, "descriptors left alive"
    assert CORE.jax_rope_sim_live_executors() == 0, "executors left alive"


def case(shapes, kernel=True, tol=2e-5, pse=None, **kw):
    """Forward and jax.grad wrt q, k, v (and pse) on this platform's path against
    the fallback; `kernel`: whether section 6 covers the call (then the NPU kernel
    runs on A2/A3)."""
    q, k, v = (normal(s, i) for i, s in enumerate(shapes))
    args = (q, k, v) + ((pse,) if pse is not None else ())

    def attention(q, k, v, *p):
        return jr.flash_attention_score(q, k, v, pse=p[0] if p else None, **kw)

    fwd = jax.jit(attention)
    text = fwd.lower(*args).as_text()
    assert (FWD in text) == (KERNEL and kernel), \
        "the forward is not " + ("the NPU kernel" if KERNEL and kernel else "the fallback")
    got = fwd(*args)
    dout = normal(got[0].shape, 9)
    loss = lambda *a: jnp.sum(attention(*a)[0] * dout)
    argnums = tuple(range(len(args)))
    grad = jax.jit(jax.grad(loss, argnums=argnums))
    assert (BWD in grad.lower(*args).as_text()) == (KERNEL and kernel), "the backward's path"
    got_grads = grad(*args)
    with jr.backend("fallback"):
        want = jax.jit(attention)(*args)
        want_grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    for g, w in zip(tuple(got) + tuple(got_grads), tuple(want) + tuple(want_grads)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=tol, atol=tol)
    assert_clean()
    return got


def bsnd(b, sq, skv, n1, n2, d):
    return [(b, sq, n1, d), (b, skv, n2, d), (b, skv, n2, d)]


def tnd(tq, tkv, n1, n2, d):
    return [(tq, n1, d), (tkv, n2, d), (tkv, n2, d)]


def slopes(*shape):
    return jnp.asarray(np.linspace(0.1, 0.9, int(np.prod(shape))).reshape(shape), jnp.float32)


@check
def pse_types_0_and_1_full_and_row():
    # V1 for type 1, V2 (pseType 0) otherwise; (B|1, N1, Sq|1, Skv) as the tiling reads it.
    mask = jnp.asarray(np.random.default_rng(3).random((2, 1, 5, 7)) < 0.3)
    for pse_type, shape in ((1, (2, 4, 5, 7)), (0, (1, 4, 1, 7)), (0, (2, 4, 5, 7))):
        case(bsnd(2, 5, 7, 4, 2, 16), pse=normal(shape, 5), pse_type=pse_type,
             atten_mask=mask)
    case([(2, 4, 6, 16), (2, 2, 6, 16), (2, 2, 6, 16)], input_layout="BNSD", sparse_mode=2,
         pse=normal((1, 4, 1, 6), 6), pse_type=1)


@check
def alibi_with_start_offsets():
    # pseType 2/3 with offsets through V2 (only element 0 of the offset arrays is
    # read); slopes (N1,) and (B, N1). Sq != Skv is not covered: the fallback.
    case(bsnd(2, 6, 6, 4, 2, 16), pse=slopes(4), pse_type=2, q_start_idx=2, kv_start_idx=1)
    case(bsnd(2, 6, 6, 4, 4, 16), pse=slopes(2, 4), pse_type=3, sparse_mode=3)
    case([(6, 2, 4 * 16), (6, 2, 4 * 16), (6, 2, 4 * 16)], input_layout="SBH", head_num=4,
         pse=slopes(4), pse_type=2, kv_start_idx=3)
    case(bsnd(1, 4, 6, 2, 2, 16), kernel=False, pse=slopes(2), pse_type=2)


@check
def tnd_packed_pse_and_mode8_alibi():
    # TND: the packed full / row forms go as per-sequence blocks (1-D); mode 8
    # ALiBi with the cut sequence's offsets (spec example 5: 2 + 1 == 3 + 0).
    lens = dict(actual_seq_qlen=[3, 7], actual_seq_kvlen=[4, 9])
    full = normal((2 * (3 * 4 + 4 * 5),), 7)
    row = normal((2 * 9,), 8)
    for pse, pse_type in ((full, 1), (row, 0)):
        case(tnd(7, 9, 2, 1, 16), input_layout="TND", pse=pse, pse_type=pse_type, **lens)
    case(tnd(5, 6, 2, 2, 16), input_layout="TND", sparse_mode=8, pre_tokens=4, next_tokens=1,
         actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6], pse=slopes(2), pse_type=2,
         q_start_idx=1)
    case(tnd(6, 6, 2, 2, 16), input_layout="TND", sparse_mode=3, actual_seq_qlen=[2, 6],
         actual_seq_kvlen=[2, 6], pse=slopes(2, 2), pse_type=3)


def _d_only(rows, width, heads, slope):
    # the last 1024 rows of an ALiBi-like bias of d = i - j over a width x width grid
    i = np.arange(width - rows, width)[:, None]
    j = np.arange(width)[None, :]
    return np.stack([-s * np.abs(i - j) for s in slope])[None].astype(np.float32)


@check
def compressed_pse_read_as_the_npu_reads_it():
    # Sq == Skv > 1024, mode 2/3: the operator reads other (equal) entries of the
    # 1024-row form; with a bias of i - j only, the result is the spec's.
    s = 1040
    pse = jnp.asarray(_d_only(1024, s, 1, [0.01]))
    case(bsnd(1, s, s, 1, 1, 8), tol=5e-5, pse=pse, pse_type=1, sparse_mode=2)
    # TND, every Sq_b == Skv_b, width max Skv_b
    pse = jnp.asarray(_d_only(1024, 1030, 1, [0.02]))
    case(tnd(1040, 1040, 1, 1, 8), tol=5e-5, input_layout="TND", sparse_mode=3,
         actual_seq_qlen=[1030, 1040], actual_seq_kvlen=[1030, 1040], pse=pse, pse_type=0)
    # mode 0: the operator takes the compressed form only in modes 2/3
    case(bsnd(1, s, s, 1, 1, 8), kernel=False, tol=5e-5, pse=jnp.asarray(_d_only(1024, s, 1,
                                                                                  [0.01])))


def _last_drop_mask():
    size = CORE.jax_rope_sim_last_drop_mask(None, 0)
    buf = (ctypes.c_uint8 * max(size, 1))()
    CORE.jax_rope_sim_last_drop_mask(buf, size)
    return np.frombuffer(buf, np.uint8)[:size]


@check
def dropout_mask_is_the_keep_function_packed():
    # The dropMask reaching the operator is jr.dropout_keep_mask(..., packed=True)
    # bit for bit (ceil(numel/128)*16 bytes, tail 0); outputs and gradients match
    # the fallback; a caller-made mask gives the same result as its key.
    key = jax.random.key(42)
    got = case(bsnd(2, 5, 7, 4, 2, 16), keep_prob=0.8, dropout_key=key, sparse_mode=0)
    want = np.asarray(jr.dropout_keep_mask(key, 0.8, 5, 7, batch=2, heads=4, packed=True))
    if KERNEL:
        np.testing.assert_array_equal(_last_drop_mask(), want)
    again = case(bsnd(2, 5, 7, 4, 2, 16), keep_prob=0.8, dropout_mask=jnp.asarray(want))
    for g, w in zip(got, again):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    lens = dict(actual_seq_qlen=[3, 7], actual_seq_kvlen=[4, 9])
    case(tnd(7, 9, 2, 1, 16), input_layout="TND", keep_prob=0.7, dropout_key=key,
         pse=slopes(2), pse_type=2, sparse_mode=0, **{k: v for k, v in lens.items()},
         kernel=False)  # pse_type 2 needs Sq_b == Skv_b: the fallback
    case(tnd(7, 9, 2, 1, 16), input_layout="TND", keep_prob=0.7, dropout_key=key, **lens)
    want = np.asarray(jr.dropout_keep_mask(key, 0.7, 7, 9, heads=2, packed=True, **lens))
    if KERNEL:
        np.testing.assert_array_equal(_last_drop_mask(), want)


@check
def bias_dropout_outside_the_operator_takes_the_fallback():
    # Section 6: pse with a zero-length TND sequence; pse in mode 8 with unequal
    # lengths (types 0/1); traced start offsets; dropout with traced TND lengths.
    q = normal((6, 2, 16), 0)
    case(tnd(6, 7, 2, 2, 16), kernel=False, input_layout="TND", actual_seq_qlen=[3, 3, 6],
         actual_seq_kvlen=[4, 4, 7], pse=normal((2 * 7,), 3), pse_type=1)
    case(tnd(5, 7, 2, 2, 16), kernel=False, input_layout="TND", sparse_mode=8, pre_tokens=4,
         next_tokens=1, actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 7],
         pse=normal((2 * (2 * 3 + 3 * 4),), 4), pse_type=0)
    f = jax.jit(lambda off: jr.flash_attention_score(q[None], q[None], q[None], pse=slopes(2),
                                                     pse_type=2, q_start_idx=off)[0])
    assert FWD not in f.lower(jnp.int32(1)).as_text()
    g = jax.jit(lambda a, b: jr.flash_attention_score(
        q, q, q, input_layout="TND", actual_seq_qlen=a, actual_seq_kvlen=b, keep_prob=0.9,
        dropout_key=jax.random.key(1))[0])
    lens = jnp.asarray([2, 6], jnp.int32)
    assert FWD not in g.lower(lens, lens).as_text()
    if KERNEL:
        with jr.backend("ffi"):
            try:
                f.lower(jnp.int32(1))
            except ValueError as e:
                assert "traced q_start_idx/kv_start_idx" in str(e), e
            else:
                raise AssertionError("traced offsets lowered to the NPU kernel")


# --- straight into the simulated V2 operators -------------------------------------

_P, _D, _I64 = ctypes.c_void_p, ctypes.c_double, ctypes.c_int64
OPS.aclnnFlashAttentionScoreV2GetWorkspaceSize.argtypes = (
    [_P] * 10 + [_D, _D, _I64, _I64, _I64, ctypes.c_char_p, _I64, _I64, _I64] + [_P] * 6)


@check
def bias_dropout_wrong_calls_directly_are_rejected():
    keep = []

    def tensor(shape, dtype=0, itemsize=4):
        n = int(np.prod(shape))
        buf = (ctypes.c_uint8 * max(n * itemsize, 1))()
        dims = (ctypes.c_int64 * len(shape))(*shape)
        strides = (ctypes.c_int64 * len(shape))(*(int(np.prod(shape[i + 1:]))
                                                  for i in range(len(shape))))
        keep.extend([buf, dims, strides])
        h = CORE.aclCreateTensor(dims, len(shape), dtype, strides, 0, 2, dims, len(shape),
                                 buf if n else None)
        assert h
        keep.append(("t", h))
        return h

    def array(*values):
        v = (ctypes.c_int64 * len(values))(*values)
        keep.append(v)
        h = CORE.aclCreateIntArray(v, len(values))
        keep.append(("a", h))
        return h

    q, k, v, out = (tensor((1, 4, 2, 16)) for _ in range(4))
    smax, ssum, empty = tensor((1, 2, 4, 8)), tensor((1, 2, 4, 8)), tensor((0,))
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()

    def call(pse=None, pse_type=1, drop=None, keep_prob=1.0, kv=None, q_start=None,
             kv_start=None):
        return OPS.aclnnFlashAttentionScoreV2GetWorkspaceSize(
            q, kv or k, kv or v, pse, drop, None, None, None, q_start, kv_start, 0.25, keep_prob,
            2147483647, 2147483647, 2, b"BSND", 0, 0, pse_type, smax, ssum, empty, out,
            ctypes.byref(size), ctypes.byref(executor))

    def rejected(words, **kw):
        assert call(**kw) == 161002, kw
        message = CORE.aclGetRecentErrMsg().decode()
        assert words in message, message

    rejected("pseType is not default", pse_type=0)
    rejected("pse dim should be 4", pse=tensor((2, 4, 4)))
    rejected("unsupported pse shape", pse=tensor((1, 2, 3, 4)))
    rejected("pse inner mode, unsupported pse shape", pse=tensor((3,)), pse_type=2)
    rejected("INNER Pse alibi is supported only when", pse=tensor((2,)), pse_type=2,
             kv=tensor((1, 6, 2, 16)))
    rejected("FLOAT32 slopes", pse=tensor((2,), dtype=1, itemsize=2), pse_type=3)
    rejected("keepProb < 1 needs dropMaskOptional", keep_prob=0.9)
    rejected("dropMask shapeSize is invalid", keep_prob=0.9,
             drop=tensor((3,), dtype=4, itemsize=1))  # needs ceil(1*2*4*4/8) = 4 bytes
    rejected("only support uint8", keep_prob=0.9, drop=tensor((4,)))
    assert call(pse=tensor((2,)), pse_type=2, q_start=array(1), kv_start=array(0)) == 0
    assert CORE.aclDestroyAclOpExecutor(executor) == 0
    for item in keep:
        if isinstance(item, tuple):
            (CORE.aclDestroyTensor if item[0] == "t" else CORE.aclDestroyIntArray)(item[1])
    assert_clean()
