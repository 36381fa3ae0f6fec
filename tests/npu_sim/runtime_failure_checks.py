"""Runtime failure checks of contract_checks.py: the simulated CANN fails one runtime call
(jax_rope_sim_fail_next), as a device out of memory or a failed copy does. The glue must
return the FFI error naming the call, its status and CANN's message, without crashing the
process; leave no descriptor, executor, device block or pinned host block behind; and the
same call made again must compute the oracle's numbers."""

import ctypes
import re

import jax
import numpy as np

import attention_oracle as ref
import jax_rope as jr
import rope_oracle
from attention_checks import normal
from sim_libraries import CHIP, CORE, GEN

CORE.jax_rope_sim_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int32]
CORE.jax_rope_sim_set_device.argtypes = [ctypes.c_int32]
OUT_OF_MEMORY, INTERNAL = 207001, 507899  # ACL_ERROR_RT_MEMORY_ALLOCATION, _INTERNAL_ERROR
RUNTIME_FAILURE_CHECKS = {}


def rope_forward():
    """The RoPE forward copies query and key to its outputs on the device first."""
    args = [normal(s, i) for i, s in enumerate([(2, 3, 4, 128), (2, 3, 2, 128),
                                                (2, 3, 1, 128), (2, 3, 1, 128)])]
    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb(*a, layout="BSND"))
    want = rope_oracle.apply_rotary_pos_emb(*(np.asarray(a, np.float64) for a in args),
                                            layout="BSND", rotary_mode="half")
    return lambda: fn(*args), want


def attention(shapes, **kw):
    """A forward whose launch builds a compressed mask or reads the sequence table."""
    q, k, v = (normal(s, 10 + i) for i, s in enumerate(shapes))
    fn = jax.jit(lambda q, k, v: jr.flash_attention_score(q, k, v, **kw))
    want = ref.flash_attention_score(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                     **ref.ref_kwargs(kw))
    return lambda: fn(q, k, v), want


TND = dict(input_layout="TND", sparse_mode=3, actual_seq_qlen=[3, 7],
           actual_seq_kvlen=[4, 9])
TND_SHAPES = [(7, 2, 16), (9, 2, 16), (9, 2, 16)]
BSND_SHAPES = [(2, 6, 2, 16), (2, 8, 2, 16), (2, 8, 2, 16)]


def cases():
    """(runtime function, status, the glue's words for it, device, the call and its oracle).
    The two mask cases run on device 1, whose compressed masks nothing has built yet (the
    call after each failure builds it); on device 0 the call first runs once, so that the
    failure meets a built mask."""
    out = []
    if GEN >= 85 and CHIP != "unsupported":  # where the RoPE forward kernel runs
        out.append(("aclrtMemcpyAsync", INTERNAL, "aclrtMemcpyAsync (device to device)", 0,
                    rope_forward))
    if CHIP in ("A2", "A3"):  # where the attention kernels run
        mode2 = lambda: attention(BSND_SHAPES, sparse_mode=2)
        prefix = lambda: attention(BSND_SHAPES, sparse_mode=6, prefix=[3, 5])
        tnd = lambda: attention(TND_SHAPES, **TND)
        out += [("aclrtGetDevice", INTERNAL, "aclrtGetDevice", 0, mode2),
                ("aclrtMalloc", OUT_OF_MEMORY, "aclrtMalloc (compressed mask)", 1, mode2),
                ("aclrtMemcpy", INTERNAL, "aclrtMemcpy (compressed mask)", 1, prefix),
                ("aclrtMallocHost", OUT_OF_MEMORY, "aclrtMallocHost (sequence table)", 0, tnd),
                ("aclrtMemcpyAsync", INTERNAL, "aclrtMemcpyAsync (sequence table)", 0, tnd),
                ("aclrtSynchronizeStream", INTERNAL, "aclrtSynchronizeStream", 0, prefix)]
    return out


def fails_cleanly(function, status, words, call):
    """The call with `function` failing once: the error names it, and nothing is left."""
    blocks = CORE.jax_rope_sim_device_blocks()
    CORE.jax_rope_sim_fail_next(function.encode(), status)
    try:
        jax.block_until_ready(call())
    except Exception as e:  # noqa: BLE001
        message = (f"{re.escape(words)} failed with status {status}: "
                   f"EE9999 simulated CANN: injected failure of {function}")
        assert re.search(message, str(e)), str(e)
    else:
        raise AssertionError(f"the call ran through a failed {function}")
    finally:
        CORE.jax_rope_sim_fail_next(None, 0)
    assert CORE.jax_rope_sim_live_tensors() == 0, "descriptors left alive"
    assert CORE.jax_rope_sim_live_executors() == 0, "executors left alive"
    assert CORE.jax_rope_sim_device_blocks() == blocks, "device memory left behind"
    assert CORE.jax_rope_sim_pinned_blocks() == 0, "pinned host memory left behind"


def check(fn):
    RUNTIME_FAILURE_CHECKS[fn.__name__] = fn
    return fn


@check
def runtime_failures_are_ffi_errors():
    for function, status, words, device, make in cases():
        call, want = make()
        CORE.jax_rope_sim_set_device(device)
        try:
            if device == 0:
                jax.block_until_ready(call())
            fails_cleanly(function, status, words, call)
            for got, w in zip(jax.block_until_ready(call()), want):  # again, nothing failing
                np.testing.assert_allclose(np.asarray(got, np.float64), w, rtol=2e-5, atol=2e-5)
        finally:
            CORE.jax_rope_sim_set_device(0)
