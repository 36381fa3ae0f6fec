"""NPU lowering of pse / ALiBi / dropout without an NPU (issue 14, spec
attention_bias_dropout.md section 6): which calls reach FlashAttentionScore(+Grad)
when exported for the NPU platform (profile A2, CANN 8.5 by default), with which
pse operand shape and attributes, and which take the fallback. The glue and the
operators' numbers are checked against the simulated CANN in
tests/npu_sim/bias_dropout_checks.py."""

import re

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
FWD = npu.ATTENTION_FWD


@pytest.fixture(scope="module", autouse=True)
def npu_known():
    npu.enable_lowering_without_device()


def npu_calls(fn, *args):
    """(target, operand types, attributes) of each custom call of the NPU export."""
    text = jax.export.export(jax.jit(fn), platforms=[npu.PLATFORM],
                             disabled_checks=CHECKS)(*args).mlir_module()
    calls = []
    for line in text.splitlines():
        m = re.search(r'stablehlo\.custom_call @(\w+)\(.*?\)(.*)', line)
        if m:
            calls.append((m.group(1), line.split(":")[-1], m.group(2)))
    return calls


def z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def bsnd(sq=8, skv=8, dtype=jnp.float32):
    return z(2, sq, 4, 16, dtype=dtype), z(2, skv, 2, 16, dtype=dtype), z(2, skv, 2, 16, dtype=dtype)


def tnd(tq=8, tkv=8):
    return z(tq, 2, 16), z(tkv, 2, 16), z(tkv, 2, 16)


KEY = jax.random.key(0)
LENS = dict(actual_seq_qlen=[3, 8], actual_seq_kvlen=[3, 8])
UNEQUAL = dict(actual_seq_qlen=[2, 7], actual_seq_kvlen=[3, 8])  # q (2, 5), kv (3, 5)

# (name, layout, kwargs, pse shape/dtype or None, covered)
CASES = [
    ("type1_full", "BSND", {}, ((2, 4, 8, 8), jnp.float32), True),
    ("type0_row", "BSND", {"pse_type": 0}, ((1, 4, 1, 8), jnp.float32), True),
    ("alibi_offsets", "BSND", {"pse_type": 2, "q_start_idx": 1}, ((4,), jnp.float32), True),
    ("alibi_sqrt_per_batch", "BSND", {"pse_type": 3}, ((2, 4), jnp.float32), True),
    ("alibi_sq_ne_skv", "BSND_6_8", {"pse_type": 2}, ((4,), jnp.float32), False),
    ("dropout_key", "BSND", {"keep_prob": 0.9, "dropout_key": KEY}, None, True),
    ("tnd_packed_full", "TND", dict(LENS), ((2 * (9 + 25),), jnp.float32), True),
    ("tnd_alibi_equal", "TND", dict(LENS, pse_type=2), ((2,), jnp.float32), True),
    ("tnd_alibi_unequal", "TND_7", dict(UNEQUAL, pse_type=2), ((2,), jnp.float32), False),
    ("tnd_mode8_alibi_cut", "TND_7", dict(UNEQUAL, pse_type=2, q_start_idx=1, sparse_mode=8,
                                          pre_tokens=8, next_tokens=1), ((2,), jnp.float32),
     True),
    ("tnd_mode8_type1_unequal", "TND_7", dict(UNEQUAL, sparse_mode=8, pre_tokens=8,
                                              next_tokens=1), ((2 * (6 + 25),), jnp.float32),
     False),
    ("tnd_zero_length", "TND", dict(actual_seq_qlen=[3, 3, 8], actual_seq_kvlen=[3, 3, 8]),
     ((2 * 8,), jnp.float32), False),
    ("tnd_dropout", "TND", dict(LENS, keep_prob=0.8, dropout_key=KEY), None, True),
]


def _args(layout):
    if layout == "BSND_6_8":
        return bsnd(6, 8)
    if layout == "TND_7":
        return tnd(7, 8)
    return tnd() if layout == "TND" else bsnd()


@pytest.mark.parametrize("name, layout, kw, pse, covered", CASES, ids=[c[0] for c in CASES])
def test_which_calls_reach_the_npu_kernel(name, layout, kw, pse, covered):
    q, k, v = _args(layout)
    kw = dict(kw, input_layout=layout.split("_")[0])
    p = None if pse is None else jnp.full(pse[0], 0.5, pse[1])

    def loss(q, k, v, p):
        return jnp.sum(jr.flash_attention_score(q, k, v, pse=p, **kw)[0])

    calls = npu_calls(jax.grad(loss, argnums=(0, 1, 2) + ((3,) if p is not None else ())),
                      q, k, v, p)
    targets = [t for t, _, _ in calls]
    assert targets == ([FWD, npu.ATTENTION_BWD] if covered else []), targets
    if not covered:
        return
    for _, _, attrs in calls:
        assert f"pse_type = {kw.get('pse_type', 1)} : i32" in attrs
        assert f"has_pse = {int(p is not None)} : i32" in attrs
        assert f"q_start_idx = {kw.get('q_start_idx', 0)} : i64" in attrs
        assert f"keep_prob = {kw.get('keep_prob', 1.0):.6e}" in attrs.replace("0000000e", "e"), \
            attrs


def test_pse_operands_in_the_shapes_the_tiling_reads():
    # TND row form (N1 * sum Skv_b,) and packed full (N1 * sum Sq_b*Skv_b,) stay 1-D
    # per-sequence blocks; slopes (1, N1) -> (N1,); the dropMask ceil(numel/128)*16 bytes.
    q, k, v = tnd()
    full = jnp.arange(2 * (9 + 25), dtype=jnp.float32)
    fn = lambda q, k, v, p: jr.flash_attention_score(q, k, v, input_layout="TND", pse=p,
                                                     keep_prob=0.5, dropout_key=KEY, **LENS)[0]
    (_, types, _), = npu_calls(fn, q, k, v, full)
    assert "tensor<68xf32>" in types and "tensor<16xui8>" in types, types  # 68 bits
    q, k, v = bsnd()
    fn = lambda q, k, v, p: jr.flash_attention_score(q, k, v, pse=p, pse_type=2)[0]
    (_, types, _), = npu_calls(fn, q, k, v, jnp.ones((4,), jnp.float32))
    assert "tensor<4xf32>" in types, types


def test_tnd_pse_blocks_follow_the_sequences():
    # The NPU's packed row form is [N1, Skv_b] per sequence: the lowering must turn
    # the canonical head-major (N1, Tkv) back into it (and not just flatten it).
    from jax_rope.attention import npu_lowering
    from jax_rope.attention.options import AttentionOptions
    options = AttentionOptions("TND", 1.0, 0, 2**30, 2**30, False, "auto", bias="tensor",
                               bias_form="packed_row", static_lengths=((2, 3), (2, 3)))
    canonical = jnp.arange(10).reshape(2, 5)  # head n, key token t -> 5n + t
    got = np.asarray(npu_lowering._pse_operand(options, canonical))
    np.testing.assert_array_equal(got, [0, 1, 5, 6, 2, 3, 4, 7, 8, 9])


def test_uncovered_call_under_ffi_names_the_rule():
    q, k, v = bsnd()
    fn = lambda q, k, v, off: jr.flash_attention_score(q, k, v, pse=jnp.ones((4,), jnp.float32),
                                                       pse_type=2, q_start_idx=off)[0]
    assert npu_calls(fn, q, k, v, jnp.int32(1)) == []  # traced offsets: the fallback
    with jr.backend("ffi"), pytest.raises(ValueError, match="traced q_start_idx"):
        npu_calls(fn, q, k, v, jnp.int32(1))
