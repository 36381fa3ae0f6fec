"""Attention checks of contract_checks.py: jr.flash_attention_score and its
jax.grad through the NPU lowering, the NPU handlers' host twins, the launch glue
and the simulated aclnnFlashAttentionScore family (tests/npu_sim/attention.cc),
compared with the float64 NumPy oracle of attention.md."""

import ctypes
import os

import jax
import jax.numpy as jnp
import numpy as np

import attention_oracle as ref
import jax_rope as jr
from jax_rope import npu

SIM = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libopapi.so"))
ATTENTION_CHECKS = {}
FWD, BWD = npu.ATTENTION_FWD, npu.ATTENTION_BWD


def check(fn):
    ATTENTION_CHECKS[fn.__name__] = fn
    return fn


def normal(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def attention_case(shapes, tol=2e-5, **kw):
    """Forward (out and the statistics) and jax.grad wrt q, k, v against the oracle."""
    q, k, v = (normal(s, i) for i, s in enumerate(shapes))
    fwd = jax.jit(lambda q, k, v: jr.flash_attention_score(q, k, v, **kw))
    text = fwd.lower(q, k, v).as_text()
    assert FWD in text, "the forward is not the NPU kernel"
    ref_kw = ref.ref_kwargs(kw)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    for got, want in zip(fwd(q, k, v), ref.flash_attention_score(*f64, **ref_kw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    dout = normal(ref.flash_attention_score(*f64, **ref_kw)[0].shape, 9)
    loss = lambda q, k, v: jnp.sum(jr.flash_attention_score(q, k, v, **kw)[0] * dout)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert BWD in grad.lower(q, k, v).as_text(), "the backward is not the NPU kernel"
    want = ref.flash_attention_grad(*f64, np.asarray(dout, np.float64), **ref_kw)
    for got, w in zip(grad(q, k, v), want):
        np.testing.assert_allclose(np.asarray(got, np.float64), w, rtol=tol, atol=tol)
    assert SIM.jax_rope_sim_live_tensors() == 0, "descriptors left alive"


def bsnd(b, sq, skv, n1, n2, d, dv=None):
    return [(b, sq, n1, d), (b, skv, n2, d), (b, skv, n2, dv or d)]


@check
def attention_mode0_no_mask():
    attention_case(bsnd(2, 5, 7, 4, 2, 16))


@check
def attention_mode0_mask_and_band():
    mask = np.random.default_rng(3).random((2, 1, 5, 7)) < 0.3
    mask[0, 0, 1] = True  # a fully masked row: zero output, dead-row statistics
    attention_case(bsnd(2, 5, 7, 4, 2, 16), atten_mask=jnp.asarray(mask), pre_tokens=3,
                   next_tokens=2)


@check
def attention_mode2_bnsd_value_dim():
    attention_case([(2, 4, 6, 16), (2, 2, 6, 16), (2, 2, 6, 8)], input_layout="BNSD",
                   sparse_mode=2)


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
def attention_tnd_varlen_mode8_split():
    # attention.md's worked example: device 2 of a 5x4 leftUpCausal sequence cut 2+3
    attention_case([(12, 2, 16), (13, 2, 16), (13, 2, 16)], input_layout="TND", sparse_mode=8,
                   actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13], pre_tokens=4,
                   next_tokens=1)


@check
def attention_tnd_causal_with_sq_above_skv_is_rejected():
    # The VarLen operator documents "sparse_mode=3 needs Sq <= Skv in every batch";
    # jax_rope accepts it (lengths may be traced, so the lowering cannot route it
    # to the fallback): the NPU call fails loudly instead of computing something else.
    q, k = normal((4, 2, 16), 0), normal((2, 2, 16), 1)
    try:
        jax.block_until_ready(jr.flash_attention_score(
            q, k, k, input_layout="TND", sparse_mode=3, actual_seq_qlen=[4],
            actual_seq_kvlen=[2]))
    except Exception as e:  # noqa: BLE001
        text = str(e)
        assert "aclnnFlashAttentionVarLenScoreGetWorkspaceSize failed with status 161002" in text, text
        assert "needs Sq <= Skv in every batch" in text, text
        assert SIM.jax_rope_sim_live_tensors() == 0
        return
    raise AssertionError("the off-contract call was accepted")


@check
def attention_950_lowers_to_fallback():
    assert npu.current_profile()[0].name == "950"  # no FlashAttentionScore there
    q, k, v = (normal(s, i) for i, s in enumerate(bsnd(1, 4, 4, 2, 2, 16)))
    loss = lambda q, k, v: jnp.sum(jr.flash_attention_score(q, k, v, sparse_mode=2)[0])
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert FWD not in text and BWD not in text
    got = jr.flash_attention_score(q, k, v, sparse_mode=2)[0]
    want = ref.flash_attention_score(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                     sparse_mode=2)[0]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


# --- straight into the simulated operator ------------------------------------------

_P, _D, _I64 = ctypes.c_void_p, ctypes.c_double, ctypes.c_int64
SIM.aclCreateTensor.restype = _P
SIM.aclCreateTensor.argtypes = [_P, ctypes.c_uint64, ctypes.c_int32, _P, _I64, ctypes.c_int32, _P,
                                ctypes.c_uint64, _P]
SIM.aclDestroyTensor.argtypes = [_P]
SIM.aclGetRecentErrMsg.restype = ctypes.c_char_p
SIM.aclnnFlashAttentionScoreGetWorkspaceSize.argtypes = (
    [_P] * 7 + [_P, _D, _D, _I64, _I64, _I64, ctypes.c_char_p, _I64, _I64] + [_P] * 4 + [_P, _P])
SIM.aclnnFlashAttentionScore.argtypes = [_P, ctypes.c_uint64, _P, _P]


class _Tensors:
    def __init__(self):
        self.keep, self.handles = [], []

    def make(self, shape, dtype=0, itemsize=4):
        n = int(np.prod(shape))
        buf = (ctypes.c_uint8 * max(n * itemsize, 1))()
        dims = (ctypes.c_int64 * len(shape))(*shape)
        strides = (ctypes.c_int64 * len(shape))(*np.cumprod((1,) + shape[:0:-1])[::-1])
        self.keep += [buf, dims, strides]
        h = SIM.aclCreateTensor(dims, len(shape), dtype, strides, 0, 2, dims, len(shape),
                                buf if n else None)
        assert h, "aclCreateTensor failed"
        self.handles.append(h)
        return h

    def destroy(self):
        for h in self.handles:
            assert SIM.aclDestroyTensor(h) == 0


@check
def attention_wrong_calls_directly_are_rejected():
    t = _Tensors()
    q, k, v, out = (t.make((1, 4, 2, 16)) for _ in range(4))
    smax, ssum = t.make((1, 2, 4, 8)), t.make((1, 2, 4, 8))
    empty = t.make((0,))
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()

    def call(layout=b"BSND", sparse=0, softmax_out=empty, stats=smax, mask=None, keep=1.0):
        return SIM.aclnnFlashAttentionScoreGetWorkspaceSize(
            q, k, v, None, None, None, mask, None, 0.25, keep, 2147483647, 2147483647, 2,
            layout, 0, sparse, stats, ssum, softmax_out, out, ctypes.byref(size),
            ctypes.byref(executor))

    def rejected(status, words, **kw):
        assert call(**kw) == status, kw
        message = SIM.aclGetRecentErrMsg().decode()
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
    assert SIM.aclnnFlashAttentionScore(None, size.value, executor, None) == 161002
    assert "workspace of" in SIM.aclGetRecentErrMsg().decode()
    work = (ctypes.c_uint8 * size.value)()
    assert SIM.aclnnFlashAttentionScore(work, size.value, executor, None) == 0
    t.destroy()
    assert SIM.jax_rope_sim_live_tensors() == 0
