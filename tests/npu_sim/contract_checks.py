"""Runs jax_rope's NPU path on the CPU against the simulated CANN runtime.

Started by tests/test_npu_contract.py in a subprocess whose ASCEND_HOME_PATH
points at the simulated libraries and whose JAX_ROPE_NPU_HOST_HANDLERS names the
test-only library of the NPU handlers' host twins (tests/npu_sim/host_handlers.cc,
built by CMake under JAX_ROPE_BUILD_TESTS), with the names of the checks to run
(each applies to the chip profiles that cover it: nothing is skipped). The NPU
lowering rules are registered for "cpu" and the host twins under the NPU target
names, so jr.apply_rotary_pos_emb goes: NPU lowering -> NPU handler body ->
launch glue -> dlopen'd (simulated) ACLNN. Prints one line per check:
"ok NAME" or "FAIL NAME: why".
"""

import ctypes
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attention_oracle  # noqa: E402
import rope_oracle as oracle  # noqa: E402

import jax_rope as jr  # noqa: E402
from jax_rope import npu  # noqa: E402
from jax_rope.core.primitive import DEFINITIONS  # noqa: E402

SIM = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libopapi.so"))
# The NPU lowering of every primitive, registered for "cpu" as well.
for definition in DEFINITIONS.values():
    if npu.PLATFORM in definition.local_rules:
        mlir.register_lowering(definition.local, definition.local_rules[npu.PLATFORM],
                               platform="cpu")
# The host twins (extern "C" handler symbols) under the NPU target names.
HOST_TWINS = ctypes.CDLL(os.environ["JAX_ROPE_NPU_HOST_HANDLERS"])
for name, symbol in {npu.ROPE_FWD: "JaxRopeNpuHostRopeForward",
                     npu.ROPE_BWD: "JaxRopeNpuHostRopeBackward",
                     npu.ROPE_BWD_NO_INPUTS: "JaxRopeNpuHostRopeBackwardNoInputs",
                     npu.ATTENTION_FWD: "JaxRopeNpuHostAttentionForward",
                     npu.ATTENTION_BWD: "JaxRopeNpuHostAttentionBackward"}.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(HOST_TWINS, symbol)),
                                platform="cpu")

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed + len(shape)).standard_normal(shape), dtype)


def assert_no_live_descriptors():
    assert SIM.jax_rope_sim_live_tensors() == 0, "descriptors left alive"


def forward_case(layout, mode, shapes, dtype=jnp.float32, tol=1e-6):
    q, k, c, s = (rand(x, dtype, i) for i, x in enumerate(shapes))
    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb(*a, layout=layout, rotary_mode=mode))
    assert "jax_rope_npu_rope_fwd" in fn.lower(q, k, c, s).as_text(), "not the NPU kernel"
    got = fn(q, k, c, s)
    want = oracle.apply_rotary_pos_emb(*(np.asarray(x, np.float64) for x in (q, k, c, s)),
                                       layout=layout, rotary_mode=mode)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(rand(shapes[0], dtype, 0)))  # intact
    assert_no_live_descriptors()


@check
def forward_bsnd_half():
    forward_case("BSND", "half", [(2, 3, 4, 128), (2, 3, 2, 128), (2, 3, 1, 128), (2, 3, 1, 128)])


@check
def forward_bsnd_partial_interleave_bf16():
    forward_case("BSND", "interleave", [(2, 3, 4, 128), (2, 3, 1, 128), (2, 3, 1, 64),
                                        (2, 3, 1, 64)], jnp.bfloat16, tol=3e-2)


@check
def forward_tnd_quarter():
    forward_case("TND", "quarter", [(5, 3, 64), (5, 2, 64), (5, 1, 64), (5, 1, 64)])


@check
def forward_float16_matches_fallback():
    shapes = [(1, 4, 2, 64), (1, 4, 2, 64), (1, 4, 1, 64), (1, 4, 1, 64)]
    q, k, c, s = (rand(x, jnp.float16, i) for i, x in enumerate(shapes))
    npu_out = jax.jit(jr.apply_rotary_pos_emb)(q, k, c, s)
    with jr.backend("fallback"):
        ref = jax.jit(jr.apply_rotary_pos_emb)(q, k, c, s)
    for a, b in zip(npu_out, ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-3, atol=1e-3)


@check
def backward_950_with_tables():
    assert npu.current_profile()[0].name == "950"
    shapes = [(2, 3, 4, 64), (2, 3, 2, 64), (1, 3, 1, 64), (1, 3, 1, 64)]
    q, k, c, s = (rand(x, jnp.float32, i) for i, x in enumerate(shapes))
    gq, gk = rand(shapes[0], seed=7), rand(shapes[1], seed=8)
    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb_grad(*a[:4], query=a[4], key=a[5]))
    assert "jax_rope_npu_rope_bwd" in fn.lower(gq, gk, c, s, q, k).as_text()
    got = fn(gq, gk, c, s, q, k)
    want = oracle.apply_rotary_pos_emb_grad(*(np.asarray(x, np.float64)
                                              for x in (gq, gk, c, s, q, k)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
    no_inputs = jax.jit(lambda *a: jr.apply_rotary_pos_emb_grad(*a)[:2])(gq, gk, c, s)
    for g, w in zip(no_inputs, want[:2]):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
    assert_no_live_descriptors()


@check
def backward_a2_lowers_to_fallback():
    # A2 has no fused RoPE backward: the gradient lowers to the jnp fallback
    # (no NPU custom call), and still matches the oracle.
    assert npu.current_profile()[0].name == "A2"
    shapes = [(2, 3, 4, 64), (2, 3, 2, 64), (2, 3, 1, 64), (2, 3, 1, 64)]
    q, k, c, s = (rand(x, jnp.float32, i) for i, x in enumerate(shapes))
    gq, gk = rand(shapes[0], seed=7), rand(shapes[1], seed=8)
    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb_grad(*a[:4], query=a[4], key=a[5]))
    text = fn.lower(gq, gk, c, s, q, k).as_text()
    assert "jax_rope_npu_rope_bwd" not in text and "jax_rope_npu" not in text, "not the fallback"
    want = oracle.apply_rotary_pos_emb_grad(*(np.asarray(x, np.float64)
                                              for x in (gq, gk, c, s, q, k)))
    for g, w in zip(fn(gq, gk, c, s, q, k), want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
    step = lambda *a: jax.vjp(jr.apply_rotary_pos_emb, *a)  # forward: NPU kernel; pullback: jnp
    vjp_text = jax.jit(lambda *a: (step(*a)[0], step(*a)[1](a[:2]))).lower(q, q, c, s).as_text()
    assert "jax_rope_npu_rope_fwd" in vjp_text and "jax_rope_npu_rope_bwd" not in vjp_text


@check
def wrong_call_through_handler_is_an_ffi_error():
    # A raw call the lowering would never make (D = 96): the simulated operator
    # rejects it and its message comes back through aclGetRecentErrMsg.
    q = rand((1, 2, 2, 96))
    c = rand((1, 2, 1, 96))
    call = jax.ffi.ffi_call("jax_rope_npu_rope_fwd", (jax.ShapeDtypeStruct(q.shape, q.dtype),) * 2)
    try:
        jax.block_until_ready(call(q, q, c, c, layout=np.int32(1), rotary_mode=np.int32(0)))
    except Exception as e:  # noqa: BLE001
        text = str(e)
        assert "aclnnApplyRotaryPosEmbV2GetWorkspaceSize failed with status 161002" in text, text
        assert "simulated CANN" in text and "D and r must be 64 or 128" in text, text
        assert_no_live_descriptors()
        return
    raise AssertionError("the wrong call was accepted")


@check
def wrong_call_directly_is_rejected():
    # Straight into the simulated ACLNN: a bad rotaryMode string and a bad layout.
    dims = (ctypes.c_int64 * 4)(1, 1, 1, 64)
    strides = (ctypes.c_int64 * 4)(64, 64, 64, 1)
    buf = (ctypes.c_float * 64)()
    SIM.aclCreateTensor.restype = ctypes.c_void_p
    make = lambda: ctypes.c_void_p(SIM.aclCreateTensor(dims, 4, 0, strides, 0, 2, dims, 4, buf))
    t = [make() for _ in range(4)]
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    for layout, mode in ((1, b"rotate"), (4, b"half")):
        status = SIM.aclnnApplyRotaryPosEmbV2GetWorkspaceSize(
            *t, ctypes.c_int64(layout), ctypes.c_char_p(mode), ctypes.byref(size),
            ctypes.byref(executor))
        assert status == 161002, status
    # a launch without the workspace it asked for
    assert SIM.aclnnApplyRotaryPosEmbV2GetWorkspaceSize(
        *t, ctypes.c_int64(1), ctypes.c_char_p(b"half"), ctypes.byref(size),
        ctypes.byref(executor)) == 0 and size.value > 0
    assert SIM.aclnnApplyRotaryPosEmbV2(None, ctypes.c_uint64(size.value), executor, None) == 161002
    for x in t:
        assert SIM.aclDestroyTensor(x) == 0
    assert SIM.aclDestroyTensor(t[0]) == 161002  # a second destroy is caught


@check
def describe_reports_simulated_runtime():
    info = jr.describe(as_dict=True)
    assert info["NPU runtime"].startswith("available (libopapi from "), info["NPU runtime"]
    assert "from SoC" in info["NPU profile"], info["NPU profile"]


from attention_checks import ATTENTION_CHECKS  # noqa: E402

CHECKS.update(ATTENTION_CHECKS)

if __name__ == "__main__":
    for name in sys.argv[1:] or list(CHECKS):
        fn = CHECKS[name]
        try:
            fn()
            print(f"ok {name}", flush=True)
        except Exception:  # noqa: BLE001 - reported to the test
            print(f"FAIL {name}: " + traceback.format_exc().replace("\n", " | "), flush=True)
