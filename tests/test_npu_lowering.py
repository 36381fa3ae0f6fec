"""NPU lowering without an NPU: jitted functions exported for the NPU platform
(made known to JAX with jax_rope.npu.enable_lowering_without_device) contain our
NPU custom calls with the expected operands and attributes where the chip
profile covers the call, and the jnp fallback (no custom call) where not."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr
from jax_rope import npu
from jax_rope.core import extension as _extension

pytestmark = pytest.mark.skipif(not _extension.STATUS.loaded,
                                reason="compiled extension not loaded")

CHECKS = [jax.export.DisabledSafetyCheck.custom_call(t) for t in npu.FFI_TARGETS + jr.FFI_TARGETS]


@pytest.fixture(scope="module", autouse=True)
def npu_known():
    npu.enable_lowering_without_device()


def export_text(fn, *args, platform=npu.PLATFORM):
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=CHECKS)(*args)
    return exported.mlir_module()


def custom_calls(text):
    """(target, operand count, attribute text) of every custom call."""
    calls = []
    for line in text.splitlines():
        m = re.search(r'stablehlo\.custom_call @(\w+)\(([^)]*)\)(.*)', line)
        if m:
            operands = [x for x in m.group(2).split(",") if x.strip()]
            calls.append((m.group(1), len(operands), m.group(3)))
    return calls


def arrays(*shapes, dtype=jnp.float16):
    return [jnp.zeros(s, dtype) for s in shapes]


def test_rope_forward_and_backward_targets_on_950():
    # 950 has the fused backward: forward and backward both lower to NPU kernels.
    q, k, c, s = arrays((2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 128), (1, 8, 1, 128))

    def step(q, k, c, s):
        (qo, ko), pullback = jax.vjp(jr.apply_rotary_pos_emb, q, k, c, s)
        return pullback((qo, ko))

    env = dict(os.environ, JAX_ROPE_NPU_PROFILE="950", JAX_ROPE_CANN_VERSION="9.0")
    code = (
        "import jax, jax.numpy as jnp, jax_rope as jr\n"
        "from jax_rope import npu\n"
        "npu.enable_lowering_without_device()\n"
        "z = lambda s: jnp.zeros(s, jnp.float16)\n"
        "q, k, c, s = z((2, 8, 4, 128)), z((2, 8, 2, 128)), z((1, 8, 1, 128)), z((1, 8, 1, 128))\n"
        "def step(q, k, c, s):\n"
        "    (qo, ko), pullback = jax.vjp(jr.apply_rotary_pos_emb, q, k, c, s)\n"
        "    return pullback((qo, ko))\n"
        "checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in npu.FFI_TARGETS]\n"
        "print(jax.export.export(jax.jit(step), platforms=['npu'], disabled_checks=checks)"
        "(q, k, c, s).mlir_module())\n")
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout
    calls = custom_calls(text)
    targets = [t for t, _, _ in calls]
    assert targets == ["jax_rope_npu_rope_fwd", "jax_rope_npu_rope_bwd"], targets
    fwd, bwd = calls
    assert fwd[1] == 4 and bwd[1] == 6
    for _, _, attrs in calls:
        assert "layout = 1 : i32" in attrs and "rotary_mode = 0 : i32" in attrs


@pytest.mark.parametrize("wrt, target, operands", [
    ((0, 1, 2, 3), "jax_rope_npu_rope_single_bwd", 6),  # dcos/dsin wanted: query/key go too
    ((0, 1), "jax_rope_npu_rope_single_bwd_no_inputs", 4)])
def test_a2_backward_uses_rotary_position_embedding_grad(wrt, target, operands):
    # A2 (default profile, CANN 8.5): the forward through ApplyRotaryPosEmbV2, the
    # backward through RotaryPositionEmbeddingGrad, one custom call per backward.
    q, k, c, s = arrays((2, 8, 4, 128), (2, 8, 2, 128), (2, 8, 1, 128), (2, 8, 1, 128))
    loss = lambda q, k, c, s: sum(jnp.sum(o.astype(jnp.float32))
                                  for o in jr.apply_rotary_pos_emb(q, k, c, s))
    calls = custom_calls(export_text(jax.value_and_grad(loss, argnums=wrt), q, k, c, s))
    assert [t for t, _, _ in calls] == ["jax_rope_npu_rope_fwd", target]
    _, n, attrs = calls[1]
    assert n == operands and "layout = 1 : i32" in attrs and "rotary_mode = 0 : i32" in attrs


def bwd_targets(monkeypatch, profile, shapes, cann=None, inputs=True, layout="BSND",
                dtype=jnp.float16):
    """The custom calls of jr.apply_rotary_pos_emb_grad exported for `profile`."""
    monkeypatch.setenv("JAX_ROPE_NPU_PROFILE", profile)
    if cann:
        monkeypatch.setenv("JAX_ROPE_CANN_VERSION", cann)
    gq, gk, c = arrays(*shapes, dtype=dtype)
    if inputs:
        fn = lambda gq, gk, c: jr.apply_rotary_pos_emb_grad(gq, gk, c, c, gq, gk, layout=layout)
    else:
        fn = lambda gq, gk, c: jr.apply_rotary_pos_emb_grad(gq, gk, c, c, layout=layout)[:2]
    return [t for t, _, _ in custom_calls(export_text(fn, gq, gk, c))]


SINGLE = ["jax_rope_npu_rope_single_bwd"]


@pytest.mark.parametrize("profile, cann, shapes, layout, inputs, want", [
    # covered: half, r == D, BSND (cos batch 1 or B < S) and TND (as (1, T, N, D))
    ("A2", None, [(2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 128)], "BSND", True, SINGLE),
    ("A3", None, [(2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 1, 64)], "BSND", True, SINGLE),
    ("A2", None, [(6, 4, 96), (6, 1, 96), (6, 1, 96)], "TND", True, SINGLE),
    ("A2", None, [(1, 4, 2, 894), (1, 4, 2, 894), (1, 4, 1, 894)], "BSND", True, SINGLE),
    # partial rotary, D >= 896, SBND (the forward's layouts only), cos batch B >= S
    ("A2", None, [(2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 64)], "BSND", True, []),
    ("A2", None, [(1, 4, 2, 896), (1, 4, 2, 896), (1, 4, 1, 896)], "BSND", True, []),
    ("A2", None, [(8, 2, 4, 64), (8, 2, 2, 64), (8, 1, 1, 64)], "SBND", True, []),
    ("A2", None, [(8, 8, 4, 64), (8, 8, 2, 64), (8, 8, 1, 64)], "BSND", True, []),
    # B * N > 1024 only matters when dcos/dsin are computed
    ("A2", None, [(2, 4, 513, 64), (2, 4, 1, 64), (1, 4, 1, 64)], "BSND", True, []),
    ("A2", None, [(2, 4, 513, 64), (2, 4, 1, 64), (1, 4, 1, 64)], "BSND", False,
     ["jax_rope_npu_rope_single_bwd_no_inputs"]),
    # CANN 8.0 lacks the operator; 310P has none; 950 uses ApplyRotaryPosEmbGrad (9.0)
    ("A2", "8.0", [(2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 128)], "BSND", True, []),
    ("310P", None, [(2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 128)], "BSND", True, []),
    ("950", "8.5", [(2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 128)], "BSND", True, []),
    ("950", "9.0", [(2, 8, 4, 128), (2, 8, 2, 128), (1, 8, 1, 128)], "BSND", True,
     ["jax_rope_npu_rope_bwd"])])
def test_backward_coverage_per_profile(monkeypatch, profile, cann, shapes, layout, inputs, want):
    assert bwd_targets(monkeypatch, profile, shapes, cann, inputs, layout) == want


def test_a2_backward_outside_the_operator_is_an_error_under_ffi(monkeypatch):
    with jr.backend("ffi"), pytest.raises(ValueError, match="needs B < S"):
        bwd_targets(monkeypatch, "A2", [(8, 8, 4, 64), (8, 8, 2, 64), (8, 8, 1, 64)])


def test_rope_tnd_attributes():
    q, k, c, s = arrays((6, 4, 64), (6, 1, 64), (6, 1, 64), (6, 1, 64))
    text = export_text(lambda *a: jr.apply_rotary_pos_emb(*a, layout="TND"), q, k, c, s)
    (target, operands, attrs), = custom_calls(text)
    assert target == "jax_rope_npu_rope_fwd" and operands == 4
    assert "layout = 4 : i32" in attrs and "rotary_mode = 0 : i32" in attrs


def rope_targets(monkeypatch, profile, shapes, dtype=jnp.float16, cann=None, **kw):
    """The custom calls of jr.apply_rotary_pos_emb exported for `profile`."""
    monkeypatch.setenv("JAX_ROPE_NPU_PROFILE", profile)
    if cann:
        monkeypatch.setenv("JAX_ROPE_CANN_VERSION", cann)
    q, k, c, s = arrays(*shapes, shapes[2], dtype=dtype)
    fn = lambda *a: jr.apply_rotary_pos_emb(*a, **kw)  # a new function: no lowering cache
    return [t for t, _, _ in custom_calls(export_text(fn, q, k, c, s))]


BSND_128 = [(2, 8, 4, 128), (2, 8, 2, 128), (2, 8, 1, 128)]


@pytest.mark.parametrize("profile", ["A2", "A3", "310P", "950"])
@pytest.mark.parametrize("mode", ["interleave", "quarter"])
def test_w3_old_chips_compute_half_only(monkeypatch, profile, mode):
    # The A2/A3/310P kernel never reads rotary_mode (it would compute half):
    # interleave/quarter take the fallback there; the 950 kernel computes them.
    targets = rope_targets(monkeypatch, profile, BSND_128, rotary_mode=mode)
    assert targets == (["jax_rope_npu_rope_fwd"] if profile == "950" else [])
    assert rope_targets(monkeypatch, profile, BSND_128, rotary_mode="half") == \
        ["jax_rope_npu_rope_fwd"]


@pytest.mark.parametrize("heads, dtype, covered", [
    (76, jnp.float32, True), (77, jnp.float32, False), (77, jnp.bfloat16, False),
    (152, jnp.float16, True), (153, jnp.float16, False)])
def test_w4_rope_ub_formula_on_a2(monkeypatch, heads, dtype, covered):
    # aclnnApplyRotaryPosEmbV2.md's per-token UB formula (192 KiB), not Nq + Nk <= 255.
    shapes = [(1, 2, heads - 1, 128), (1, 2, 1, 128), (1, 2, 1, 128)]
    assert rope_targets(monkeypatch, "A2", shapes, dtype) == \
        (["jax_rope_npu_rope_fwd"] if covered else [])


@pytest.mark.parametrize("profile", ["A2", "950"])
def test_w11_partial_rotary_only_where_the_cann_accepts_it(monkeypatch, profile):
    shapes = [(1, 8, 4, 128), (1, 8, 2, 128), (1, 8, 1, 64)]
    assert rope_targets(monkeypatch, profile, shapes, cann="8.5") == []
    assert rope_targets(monkeypatch, profile, shapes, cann="9.0") == ["jax_rope_npu_rope_fwd"]
    with jr.backend("ffi"), pytest.raises(ValueError, match="partial rotary"):
        rope_targets(monkeypatch, profile, shapes, cann="8.5")


def test_w2_operators_of_the_cann_generation(monkeypatch):
    # Without a runtime, the CANN generation says which operators exist: 8.0 has no
    # ApplyRotaryPosEmbV2 (RoPE falls back) but FlashAttentionScore.
    assert rope_targets(monkeypatch, "A2", BSND_128, cann="8.0") == []
    q, k, v = attention_args()
    fn = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=2)[0]
    assert [t for t, _, _ in custom_calls(export_text(fn, q, k, v))] == \
        ["jax_rope_npu_attention_fwd"]
    info = jr.describe(as_dict=True)
    assert info["NPU operators"]["aclnnApplyRotaryPosEmbV2"] == "missing"
    assert info["NPU CANN"].startswith("8.0 generation")


@pytest.mark.parametrize("soc, profile", [
    ("Ascend910B1", "A2"), ("Ascend910B4-1", "A2"), ("Ascend910_9391", "A3"),
    ("Ascend310P3", "310P"), ("Ascend910_9599", "950"), ("Ascend950PR_9579", "950"),
    ("Ascend910A", None), ("Ascend910ProB", None), ("Ascend910PremiumA", None),
    ("Ascend310B1", None), ("Ascend910B", None)])
def test_w12_soc_names(soc, profile):
    assert npu.profile_for_soc(soc) == profile


def attention_args(layout="BSND", dtype=jnp.bfloat16):
    if layout == "TND":
        return arrays((12, 4, 64), (12, 2, 64), (12, 2, 64), dtype=dtype)
    return arrays((2, 16, 4, 64), (2, 16, 2, 64), (2, 16, 2, 64), dtype=dtype)


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
def test_attention_forward_and_backward_targets(mode):
    q, k, v = attention_args()

    def loss(q, k, v):
        out, _, _ = jr.flash_attention_score(q, k, v, sparse_mode=mode, pre_tokens=8,
                                             next_tokens=0)
        return jnp.sum(out.astype(jnp.float32))

    text = export_text(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    calls = custom_calls(text)
    assert [t for t, _, _ in calls] == ["jax_rope_npu_attention_fwd", "jax_rope_npu_attention_bwd"]
    (_, fwd_n, fwd_attrs), (_, bwd_n, bwd_attrs) = calls
    # q, k, v, table, mask, pse, dropMask [+ out, dout, max, sum]
    assert fwd_n == 7 and bwd_n == 11
    for attrs in (fwd_attrs, bwd_attrs):
        assert f"sparse_mode = {mode} : i32" in attrs and "layout = 1 : i32" in attrs
        assert "pre_tokens = 8 : i64" in attrs and "next_tokens = 0 : i64" in attrs
    # the 8-wide statistics: produced by the forward, fed back to the backward
    assert "tensor<2x4x16x8xf32>" in text


def test_attention_tnd_statistics_are_sliced_to_spec_shapes():
    q, k, v = attention_args("TND")
    fn = lambda q, k, v: jr.flash_attention_score(q, k, v, input_layout="TND", sparse_mode=3,
                                                  actual_seq_qlen=[4, 12],
                                                  actual_seq_kvlen=[4, 12])
    exported = jax.export.export(jax.jit(fn), platforms=[npu.PLATFORM],
                                 disabled_checks=CHECKS)(q, k, v)
    assert [a.shape for a in exported.out_avals] == [(12, 4, 64), (12, 4), (12, 4)]
    text = exported.mlir_module()
    # W5: VarLen writes its statistics in NTD order, [N1, T, 8]
    assert "tensor<4x12x8xf32>" in text and "tensor<12x4x8xf32>" not in text
    assert [t for t, _, _ in custom_calls(text)] == ["jax_rope_npu_attention_fwd"]


@pytest.mark.parametrize("tokens, in_chunks", [(64, False), (4096, True)])
def test_attention_traced_lengths_choice_holds_the_fallback_in_chunks(tokens, in_chunks):
    # Traced TND lengths in sparse_mode 3 may hold a sequence with Sq > Skv, which the VarLen
    # operator refuses: the lowering compiles the fallback in behind a conditional on the
    # table, at every size. XLA reserves an untaken branch's temporaries too, so the fallback
    # goes through the query tokens in chunks of GRID_CHUNK_BYTES of scores (N1 x rows x Tkv
    # float32; 64 tokens: 64 KiB at once, 4096: 256 MiB in a loop of chunks).
    from jax_rope.attention.row_chunks import GRID_CHUNK_BYTES
    assert 4 * 4 * 64 * 64 <= GRID_CHUNK_BYTES < 4 * 4 * 4096 * 4096
    q = jax.ShapeDtypeStruct((tokens, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((tokens, 2, 64), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = lambda q, k, a, b: jr.flash_attention_score(q, k, k, input_layout="TND", sparse_mode=3,
                                                     actual_seq_qlen=a, actual_seq_kvlen=b)[0]
    with jr.runtime_checks(False):
        text = export_text(fn, q, k, lengths, lengths)
    assert [t for t, _, _ in custom_calls(text)] == ["jax_rope_npu_attention_fwd"]
    assert "stablehlo.case" in text
    rows = min(tokens, GRID_CHUNK_BYTES // (4 * tokens * 4))  # per chunk
    assert (rows < tokens) == in_chunks
    assert f"tensor<1x4x{rows}x{tokens}xf32>" in text  # the fallback's scores
    assert (f"tensor<1x4x{tokens}x{tokens}xf32>" in text) == (not in_chunks)


def test_attention_outside_profile_falls_back():
    q, k, v = attention_args()
    fn = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=2)[0]
    code = ("import jax, jax.numpy as jnp, jax_rope as jr\nfrom jax_rope import npu\n"
            "npu.enable_lowering_without_device()\n"
            "q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)\n"
            "f = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=2)[0]\n"
            "print(jax.export.export(jax.jit(f), platforms=['npu'])(q, q, q).mlir_module())\n")
    env = dict(os.environ, JAX_ROPE_NPU_PROFILE="310P")
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout
    assert "custom_call" not in text
    # the scores primitive has no NPU kernel anywhere
    assert custom_calls(export_text(lambda q, k: jr.attention_scores(q, k), q, k)) == []
    assert custom_calls(export_text(fn, q, k, v))[0][0] == "jax_rope_npu_attention_fwd"


def test_describe_lists_profile_and_rules():
    info = jr.describe(as_dict=True)
    assert info["NPU runtime"].startswith("absent (")
    assert info["NPU profile"].startswith("A2")
    assert "D and r in {64, 128}" in info["NPU rules"]
    assert "rotary_mode half," in info["NPU rules"] and "r == D" in info["NPU rules"]
    assert "RoPE backward (aclnnRotaryPositionEmbeddingGrad): half mode, layouts BSND/TND, " \
        "r == D <= 894" in info["NPU rules"]
    assert set(info["NPU operators"]) == {
        "aclnnApplyRotaryPosEmbV2", "aclnnApplyRotaryPosEmbGrad",
        "aclnnRotaryPositionEmbeddingGrad", "aclnnFlashAttentionScore",
        "aclnnFlashAttentionVarLenScore", "aclnnFlashAttentionScoreGrad",
        "aclnnFlashAttentionUnpaddingScoreGrad", "aclnnFlashAttentionScoreV2",
        "aclnnFlashAttentionVarLenScoreV2", "aclnnFlashAttentionScoreGradV2",
        "aclnnFlashAttentionUnpaddingScoreGradV2"}
    assert info["NPU CANN"].startswith("8.5 generation")


def test_w8_prefix_mask_broadcast_to_the_batch():
    # Mode 5 with B > 1 takes only a [B,1,S,S] / [B,N,S,S] mask: a (1,1,S,S) one is
    # broadcast before the call, and the call still reaches the NPU kernel.
    q, k, v = attention_args()
    mask = jnp.zeros((1, 1, 16, 16), jnp.bool_)
    fn = lambda q, k, v, m: jr.flash_attention_score(q, k, v, sparse_mode=5, atten_mask=m,
                                                     prefix=[4, 8])[0]
    text = export_text(fn, q, k, v, mask)
    (target, _, _), = custom_calls(text)
    assert target == "jax_rope_npu_attention_fwd"
    call = next(line for line in text.splitlines() if "custom_call @jax_rope_npu_attention" in line)
    assert "tensor<2x1x16x16xui8>" in call, call


def test_w6_mode0_band_goes_into_the_mask():
    q, k, v = attention_args()
    mask = jnp.zeros((2, 1, 16, 16), jnp.bool_)
    fn = lambda pre, nxt: (lambda q, k, v, m: jr.flash_attention_score(
        q, k, v, atten_mask=m, pre_tokens=pre, next_tokens=nxt)[0])
    banded = export_text(fn(3, 0), q, k, v, mask)
    unbanded = export_text(fn(100, 100), q, k, v, mask)
    # the band's comparisons are there only when the band excludes something
    assert "stablehlo.or" in banded and "stablehlo.or" not in unbanded.split("custom_call")[0]

