"""Runs jax_rope's NPU path on the CPU against the simulated CANN runtime.

Started by tests/test_npu_contract.py in a subprocess per simulated CANN
generation x chip: ASCEND_HOME_PATH points at a simulated CANN tree of that
generation (tests/npu_sim/sim_core.cc, sim_ops.cc, attention.cc),
JAX_ROPE_SIM_SOC names the chip, JAX_ROPE_SIM_CHIP/JAX_ROPE_SIM_GEN say what
the test expects of them (written from the audit, not from jax_rope's
profiles), and JAX_ROPE_NPU_HOST_HANDLERS names the test-only library of the
NPU handlers' host twins (tests/npu_sim/host_handlers.cc). The NPU lowering
rules are registered for "cpu" and the host twins under the NPU target names,
so jr.apply_rotary_pos_emb goes: NPU lowering -> NPU handler body -> launch
glue -> dlopen'd (simulated) ACLNN. Every check runs on every combination it
is listed for and says which path it expects there (NPU kernel or fallback),
then compares with the float64 oracle. Prints "ok NAME" or "FAIL NAME: why".
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
import rope_oracle as oracle  # noqa: E402

import jax_rope as jr  # noqa: E402
from jax_rope import npu  # noqa: E402
from jax_rope.core.primitive import DEFINITIONS  # noqa: E402

from sim_libraries import CHIP, CORE, GEN, OPS  # noqa: E402
# What the audit says each simulated combination has (the expectations).
ROPE_FWD_KERNEL = GEN >= 85 and CHIP in ("A2", "A3", "310P", "950")
# The backward: ApplyRotaryPosEmbGrad on 950 from 9.0, RotaryPositionEmbeddingGrad
# (one call per tensor) on A2/A3 where the CANN has it (8.5, 9.0).
ROPE_BWD_KERNEL = GEN >= 90 and CHIP == "950"
ROPE_SINGLE_BWD_KERNEL = GEN >= 85 and CHIP in ("A2", "A3")
ATTENTION_KERNEL = CHIP in ("A2", "A3")

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
                     npu.ROPE_SINGLE_BWD: "JaxRopeNpuHostRopeBackwardSingle",
                     npu.ROPE_SINGLE_BWD_NO_INPUTS: "JaxRopeNpuHostRopeBackwardSingleNoInputs",
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


def assert_clean():
    assert CORE.jax_rope_sim_live_tensors() == 0, "descriptors left alive"
    assert CORE.jax_rope_sim_live_executors() == 0, "executors left alive"


def assert_path(text, target, kernel):
    assert (target in text) == kernel, \
        f"expected {'the NPU kernel' if kernel else 'the fallback'} ({target}) on {CHIP}/{GEN}"


def assert_backward_path(text, with_inputs):
    """The backward's expected kernel here (by the audit), or the fallback."""
    fused = npu.ROPE_BWD if with_inputs else npu.ROPE_BWD_NO_INPUTS
    single = npu.ROPE_SINGLE_BWD if with_inputs else npu.ROPE_SINGLE_BWD_NO_INPUTS
    assert_path(text, fused, ROPE_BWD_KERNEL)
    assert_path(text, single, ROPE_SINGLE_BWD_KERNEL)


def forward_case(layout, mode, shapes, kernel, dtype=jnp.float32, tol=1e-6):
    q, k, c, s = (rand(x, dtype, i) for i, x in enumerate(shapes))
    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb(*a, layout=layout, rotary_mode=mode))
    assert_path(fn.lower(q, k, c, s).as_text(), npu.ROPE_FWD, kernel)
    got = fn(q, k, c, s)
    want = oracle.apply_rotary_pos_emb(*(np.asarray(x, np.float64) for x in (q, k, c, s)),
                                       layout=layout, rotary_mode=mode)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(rand(shapes[0], dtype, 0)))  # intact
    assert_clean()


@check
def forward_bsnd_half():
    # W2: on CANN 8.0 (no ApplyRotaryPosEmbV2) the fallback, correct all the same.
    forward_case("BSND", "half", [(2, 3, 4, 128), (2, 3, 2, 128), (2, 3, 1, 128),
                                  (2, 3, 1, 128)], ROPE_FWD_KERNEL)


@check
def rope_in_place_rotates_the_donated_buffers():
    # in_place=True aliases the NPU forward's outputs to query and key: donated, the
    # operator rotates the caller's buffers and the glue makes no device copy; without
    # in_place the glue copies query and key to the fresh outputs first.
    shapes = [(2, 3, 4, 128), (2, 3, 2, 128), (2, 3, 1, 128), (2, 3, 1, 128)]
    for in_place, copies in ((False, 2), (True, 0)):
        q, k, c, s = (rand(x, jnp.float32, i) for i, x in enumerate(shapes))
        want = oracle.apply_rotary_pos_emb(*(np.asarray(x, np.float64) for x in (q, k, c, s)),
                                           layout="BSND", rotary_mode="half")
        fn = jax.jit(lambda *a, i=in_place: jr.apply_rotary_pos_emb(*a, in_place=i),
                     donate_argnums=(0, 1))
        text = fn.lower(q, k, c, s).as_text()
        assert_path(text, npu.ROPE_FWD, True)
        assert ("output_operand_aliases" in text) == in_place, text
        before = CORE.jax_rope_sim_device_copies()
        got = jax.block_until_ready(fn(q, k, c, s))
        assert CORE.jax_rope_sim_device_copies() - before == copies, in_place
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-6, atol=1e-6)
        assert not in_place or (q.is_deleted() and k.is_deleted()), "not donated"
        assert_clean()


@check
def forward_tnd_half():
    forward_case("TND", "half", [(5, 3, 64), (5, 2, 64), (5, 1, 64), (5, 1, 64)],
                 ROPE_FWD_KERNEL)


@check
def w3_interleave_and_quarter_are_not_sent_to_old_chips():
    # The A2/A3/310P kernel ignores rotary_mode and computes half.
    for mode in ("interleave", "quarter"):
        forward_case("BSND", mode, [(2, 3, 4, 128), (2, 3, 1, 128), (2, 3, 1, 128),
                                    (2, 3, 1, 128)], ROPE_FWD_KERNEL and CHIP == "950")


@check
def w4_rope_beyond_the_ub_limit():
    # Nq + Nk = 110 at D = 128 in float32: within 255 but beyond A2/A3/310P's UB.
    forward_case("BSND", "half", [(1, 2, 104, 128), (1, 2, 6, 128), (1, 2, 1, 128),
                                  (1, 2, 1, 128)], ROPE_FWD_KERNEL and CHIP == "950")


@check
def w11_partial_rotary_only_where_the_cann_accepts_it():
    forward_case("BSND", "half", [(2, 3, 4, 128), (2, 3, 2, 128), (2, 3, 1, 64), (2, 3, 1, 64)],
                 ROPE_FWD_KERNEL and GEN >= 90)


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


def backward_with_inputs_case(gq, gk, c, s, q, k, tol):
    """The backward with query/key: its expected path here (by the audit) and the float64
    oracle within tol. Returns (the gradients, the oracle's)."""
    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb_grad(*a[:4], query=a[4], key=a[5]))
    assert_backward_path(fn.lower(gq, gk, c, s, q, k).as_text(), True)
    want = oracle.apply_rotary_pos_emb_grad(*(np.asarray(x, np.float64)
                                              for x in (gq, gk, c, s, q, k)))
    got = fn(gq, gk, c, s, q, k)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)
    return got, want


@check
def rope_16_bit_dtypes():
    # bfloat16 and float16 through the glue (ACL_BF16 / ACL_FLOAT16), forward and the
    # backward with query/key (cos batch B: the old chips' forward needs it); the 310P
    # kernel registers no bfloat16 (the fallback).
    shapes = [(2, 3, 4, 128), (2, 3, 2, 128), (2, 3, 1, 128), (2, 3, 1, 128)]
    for dtype, tol in ((jnp.bfloat16, 2e-2), (jnp.float16, 4e-3)):
        forward_case("BSND", "half", shapes, ROPE_FWD_KERNEL and not (
            CHIP == "310P" and dtype == jnp.bfloat16), dtype=dtype, tol=tol)
        q, k, c, s = (rand(x, dtype, i) for i, x in enumerate(shapes))
        gq, gk = rand(shapes[0], dtype, 7), rand(shapes[1], dtype, 8)
        for g in backward_with_inputs_case(gq, gk, c, s, q, k, tol)[0]:
            assert g.dtype == dtype, g.dtype
        assert_clean()


@check
def w10_backward_with_and_without_inputs():
    # The fused backward: Ascend 950 from CANN 9.0 (its required gradCos/gradSin
    # outputs get buffers without query/key too); RotaryPositionEmbeddingGrad on
    # A2/A3 from 8.5 (its dcosOut/dsinOut likewise); the fallback elsewhere.
    shapes = [(2, 3, 4, 64), (2, 3, 2, 64), (1, 3, 1, 64), (1, 3, 1, 64)]
    q, k, c, s = (rand(x, jnp.float32, i) for i, x in enumerate(shapes))
    gq, gk = rand(shapes[0], seed=7), rand(shapes[1], seed=8)
    want = backward_with_inputs_case(gq, gk, c, s, q, k, 1e-5)[1]
    no_inputs = jax.jit(lambda *a: jr.apply_rotary_pos_emb_grad(*a)[:2])
    assert_backward_path(no_inputs.lower(gq, gk, c, s).as_text(), False)
    for g, w in zip(no_inputs(gq, gk, c, s), want[:2]):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
    assert_clean()


@check
def a2_backward_uses_rotary_position_embedding_grad():
    # jax.grad through apply_rotary_pos_emb: on A2/A3 with the operator, one
    # RotaryPositionEmbeddingGrad call per path; dcos/dsin (when cos/sin are
    # differentiated) are each path's reduction, added: batch-1 cos (reduced over
    # B and N) and batch-B cos (B < S, reduced over N); TND as (1, T, N, D).
    cases = [("BSND", [(2, 5, 3, 64), (2, 5, 2, 64), (1, 5, 1, 64)]),
             ("BSND", [(2, 5, 3, 128), (2, 5, 1, 128), (2, 5, 1, 128)]),
             ("TND", [(7, 3, 64), (7, 1, 64), (7, 1, 64)])]
    for layout, shapes in cases:
        q, k, c = (rand(x, jnp.float32, i) for i, x in enumerate(shapes))
        s = rand(shapes[2], jnp.float32, 5)
        gq, gk = rand(shapes[0], seed=7), rand(shapes[1], seed=8)
        f = lambda *a: jr.apply_rotary_pos_emb(*a, layout=layout)
        want = oracle.apply_rotary_pos_emb_grad(
            *(np.asarray(x, np.float64) for x in (gq, gk, c, s, q, k)), layout=layout)
        full = jax.jit(lambda q, k, c, s, gq, gk: jax.vjp(f, q, k, c, s)[1]((gq, gk)))
        qk = jax.jit(lambda q, k, c, s, gq, gk:
                     jax.vjp(lambda q, k: f(q, k, c, s), q, k)[1]((gq, gk)))
        for fn, with_tables in ((full, True), (qk, False)):
            assert_backward_path(fn.lower(q, k, c, s, gq, gk).as_text(), with_tables)
            got = fn(q, k, c, s, gq, gk)
            assert len(got) == (4 if with_tables else 2)
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
    assert_clean()


@check
def rotary_position_embedding_grad_wrong_calls_are_rejected():
    # Straight into the simulated aclnnRotaryPositionEmbeddingGrad (A2/A3 contract).
    keep = []

    def tensor(*shape):
        n = int(np.prod(shape))
        dims = (ctypes.c_int64 * len(shape))(*shape)
        strides = (ctypes.c_int64 * len(shape))(*(int(np.prod(shape[i + 1:]))
                                                  for i in range(len(shape))))
        buf = (ctypes.c_float * n)()
        keep.append(buf)
        return ctypes.c_void_p(CORE.aclCreateTensor(dims, len(shape), 0, strides, 0, 2, dims,
                                                     len(shape), buf))

    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    made = []

    def prepare(dy, cos, x, mode=0, tables=True):
        t = [tensor(*dy), tensor(*cos), tensor(*cos), tensor(*dy) if x else None, tensor(*dy),
             tensor(*cos) if tables else None, tensor(*cos) if tables else None]
        made.extend(x for x in t if x is not None)
        assert all(x is None or x.value for x in t), CORE.aclGetRecentErrMsg()
        return OPS.aclnnRotaryPositionEmbeddingGradGetWorkspaceSize(
            t[0], t[1], t[2], t[3], ctypes.c_int64(mode), t[4], t[5], t[6], ctypes.byref(size),
            ctypes.byref(executor))

    assert prepare((2, 4, 3, 64), (1, 4, 1, 64), x=True, tables=False) == 161001  # dcosOut required
    assert prepare((2, 4, 3, 64), (1, 4, 1, 64), x=True, mode=2) == 561002  # no quarter on A2/A3
    assert prepare((2, 4, 3, 896), (1, 4, 1, 896), x=True) == 561002  # D < 896
    assert prepare((2, 4, 3, 64), (1, 4, 1, 32), x=True) == 561002  # cos D == dy D
    assert prepare((4, 3, 2, 64), (4, 1, 2, 64), x=True) == 561002  # B1SD needs B < S
    assert prepare((2, 4, 513, 64), (1, 4, 1, 64), x=True) == 561002  # B * N > 1024 with x
    assert prepare((2, 4, 513, 64), (1, 4, 1, 64), x=False) == 0  # fine without dcos/dsin
    assert size.value > 0
    # a launch without the workspace it asked for
    assert OPS.aclnnRotaryPositionEmbeddingGrad(None, ctypes.c_uint64(size.value), executor,
                                                None) == 161002
    assert CORE.aclDestroyAclOpExecutor(executor) == 0
    for x in made:
        assert CORE.aclDestroyTensor(x) == 0
    assert_clean()


@check
def wrong_call_through_handler_is_an_ffi_error():
    # A raw call the lowering would never make (quarter mode, D = 98): the simulated
    # operator rejects it (or the CANN lacks it) and the message comes back.
    q = rand((1, 2, 2, 98))
    c = rand((1, 2, 1, 98))
    call = jax.ffi.ffi_call(npu.ROPE_FWD, (jax.ShapeDtypeStruct(q.shape, q.dtype),) * 2)
    try:
        jax.block_until_ready(call(q, q, c, c, layout=np.int32(1), rotary_mode=np.int32(1)))
    except Exception as e:  # noqa: BLE001
        text = str(e)
        if GEN == 80:
            assert "aclnnApplyRotaryPosEmbV2 is not in this CANN's operator libraries" in text
        else:
            assert "aclnnApplyRotaryPosEmbV2GetWorkspaceSize failed with status 161002" in text
            assert "simulated CANN" in text, text
        assert_clean()
        return
    raise AssertionError("the wrong call was accepted")


@check
def wrong_call_directly_is_rejected():
    # Straight into the simulated ACLNN: a bad rotaryMode string and a bad layout.
    dims = (ctypes.c_int64 * 4)(1, 1, 1, 64)
    strides = (ctypes.c_int64 * 4)(64, 64, 64, 1)
    buf = (ctypes.c_float * 64)()
    make = lambda: ctypes.c_void_p(CORE.aclCreateTensor(dims, 4, 0, strides, 0, 2, dims, 4, buf))
    t = [make() for _ in range(4)]
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    for layout, mode in ((1, b"rotate"), (4, b"half")):  # layout 4 needs 3-D (or is not 950's)
        status = OPS.aclnnApplyRotaryPosEmbV2GetWorkspaceSize(
            *t, ctypes.c_int64(layout), ctypes.c_char_p(mode), ctypes.byref(size),
            ctypes.byref(executor))
        assert status == 161002, status
    # a launch without the workspace it asked for
    assert OPS.aclnnApplyRotaryPosEmbV2GetWorkspaceSize(
        *t, ctypes.c_int64(1), ctypes.c_char_p(b"half"), ctypes.byref(size),
        ctypes.byref(executor)) == 0 and size.value > 0
    assert OPS.aclnnApplyRotaryPosEmbV2(None, ctypes.c_uint64(size.value), executor, None) == 161002
    assert CORE.aclDestroyAclOpExecutor(executor) == 0
    for x in t:
        assert CORE.aclDestroyTensor(x) == 0
    assert CORE.aclDestroyTensor(t[0]) == 161002  # a second destroy is caught
    assert_clean()


@check
def w1_operators_resolved_per_library():
    ops = jr.describe(as_dict=True)["NPU operators"]
    library = "libopapi.so" if GEN == 80 else "libopapi_transformer.so"
    for op in ("aclnnFlashAttentionScore", "aclnnFlashAttentionVarLenScore",
               "aclnnFlashAttentionScoreGrad", "aclnnFlashAttentionUnpaddingScoreGrad"):
        assert ops[op].endswith("lib64/" + library), (op, ops[op])
    v2, grad = ops["aclnnApplyRotaryPosEmbV2"], ops["aclnnApplyRotaryPosEmbGrad"]
    single = ops["aclnnRotaryPositionEmbeddingGrad"]
    assert (v2 == "missing") == (GEN < 85) and (grad == "missing") == (GEN < 90), ops
    assert (single == "missing") == (GEN < 85), ops


@check
def describe_reports_simulated_runtime():
    info = jr.describe(as_dict=True)
    assert info["NPU runtime"].startswith("available (libascendcl from "), info["NPU runtime"]
    want = {80: "8.0", 85: "8.5", 90: "9.0"}[GEN]
    assert info["NPU CANN"].startswith(want + " generation"), info["NPU CANN"]
    assert "ascend_toolkit_install.info" in info["NPU CANN"], info["NPU CANN"]
    if CHIP == "unsupported":
        assert info["NPU profile"].startswith("none: SoC 'Ascend910A' is not supported"), info
    else:
        assert info["NPU profile"].startswith(CHIP) and "from SoC" in info["NPU profile"], info


@check
def w12_unsupported_soc_takes_the_fallback():
    # Covered by the other checks' expectations on an unsupported SoC: here the
    # error under "ffi" names the SoC.
    q = rand((1, 2, 2, 64))
    fn = lambda q: jr.apply_rotary_pos_emb(q, q, q[:, :, :1], q[:, :, :1])
    with jr.backend("ffi"):
        try:
            jax.jit(fn).lower(q)
        except ValueError as e:
            assert "SoC 'Ascend910A' is not supported" in str(e), e
            return
    raise AssertionError("an unsupported SoC lowered to an NPU kernel")


@check
def executor_freed_when_workspace_allocation_fails():
    os.environ["JAX_ROPE_NPU_HOST_WORKSPACE_LIMIT"] = "1"  # read by the host twins per call
    try:
        q = rand((1, 2, 2, 64))
        c = rand((1, 2, 1, 64))
        call = jax.ffi.ffi_call(npu.ROPE_FWD, (jax.ShapeDtypeStruct(q.shape, q.dtype),) * 2)
        try:
            jax.block_until_ready(call(q, q, c, c, layout=np.int32(1), rotary_mode=np.int32(0)))
        except Exception as e:  # noqa: BLE001
            assert "could not allocate" in str(e), e
            assert_clean()
            return
        raise AssertionError("the call ran without its workspace")
    finally:
        del os.environ["JAX_ROPE_NPU_HOST_WORKSPACE_LIMIT"]


from attention_checks import ATTENTION_CHECKS  # noqa: E402
from bias_dropout_checks import BIAS_DROPOUT_CHECKS  # noqa: E402
from runtime_failure_checks import RUNTIME_FAILURE_CHECKS  # noqa: E402

CHECKS.update(ATTENTION_CHECKS)
CHECKS.update(BIAS_DROPOUT_CHECKS)
CHECKS.update(RUNTIME_FAILURE_CHECKS)

if __name__ == "__main__":
    for name in sys.argv[1:] or list(CHECKS):
        fn = CHECKS[name]
        try:
            fn()
            print(f"ok {name}", flush=True)
        except Exception:  # noqa: BLE001 - reported to the test
            print(f"FAIL {name}: " + traceback.format_exc().replace("\n", " | "), flush=True)
