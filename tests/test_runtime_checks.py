"""Traced values are checked on every backend (issue: "nothing silently wrong"): invalid
traced lengths, prefixes, mode 7/8 tokens and 64-bit positions raise an error naming the
argument when the computation runs, on the CPU kernel and on the jnp fallback, forward and
gradient; concrete ones at trace time. The checks can be switched off (e.g. for jax.export,
which cannot serialise host callbacks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr
from conftest import require_backend

I32 = jnp.int32


def tnd(tokens=8, heads=2, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((tokens, heads, dim)), jnp.float32)
                 for _ in range(3))


def run(backend, fn, *args, grad=False, jit=True):
    """Runs fn(q, k, v, *args)[0] (or its gradient wrt q) under the backend."""
    require_backend(backend)
    q, k, v = tnd()
    call = lambda q, *a: fn(q, k, v, *a)[0]
    if grad:
        call = jax.grad(lambda q, *a: jnp.sum(fn(q, k, v, *a)[0]))
    with jr.backend(backend):
        out = (jax.jit(call) if jit else call)(q, *args)
        return jax.block_until_ready(out)


def varlen(mode=3, **kw):
    return lambda q, k, v, a, b: jr.flash_attention_score(
        q, k, v, input_layout="TND", sparse_mode=mode, actual_seq_qlen=a, actual_seq_kvlen=b,
        **kw)


BAD_LENGTHS = [
    ([2, 100], [2, 8], "actual_seq_qlen must be non-decreasing cumulative ends in \\[0, 8\\]"),
    ([4, 2], [2, 8], "actual_seq_qlen must be non-decreasing"),
    ([-1, 8], [2, 8], "actual_seq_qlen must be non-decreasing"),
    ([2, 8], [2, 9], "actual_seq_kvlen must be non-decreasing cumulative ends in \\[0, 8\\]"),
]


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
@pytest.mark.parametrize("qlen, kvlen, message", BAD_LENGTHS)
def test_invalid_traced_lengths_raise_naming_the_argument(backend, grad, qlen, kvlen, message):
    with pytest.raises(Exception, match=message):
        run(backend, varlen(), jnp.asarray(qlen, I32), jnp.asarray(kvlen, I32), grad=grad)


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("qlen, kvlen, message", BAD_LENGTHS[:2])
def test_invalid_concrete_lengths_raise_at_trace_time(backend, qlen, kvlen, message):
    with pytest.raises(ValueError, match=message):
        run(backend, varlen(), qlen, kvlen, jit=False)


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
def test_valid_traced_lengths_run_without_retracing(backend):
    require_backend(backend)
    q, k, v = tnd()
    traces = []

    def fn(q, a, b):
        traces.append(1)
        return varlen()(q, k, v, a, b)[0]

    f = jax.jit(fn)
    with jr.backend(backend):
        for qlen, kvlen in (([3, 8], [3, 8]), ([5, 8], [5, 8]), ([0, 8], [0, 8])):
            out = f(q, jnp.asarray(qlen, I32), jnp.asarray(kvlen, I32))
            want = varlen()(q, k, v, qlen, kvlen)[0]
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert len(traces) == 1


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
def test_tnd_mask_too_small_for_traced_lengths(backend):
    mask = jnp.zeros((3, 3), bool)
    fn = lambda q, k, v, a, b: jr.flash_attention_score(
        q, k, v, input_layout="TND", sparse_mode=0, atten_mask=mask, actual_seq_qlen=a,
        actual_seq_kvlen=b)
    with pytest.raises(Exception, match="atten_mask must be \\(maxSq, maxSkv\\) covering"):
        run(backend, fn, jnp.asarray([4, 8], I32), jnp.asarray([4, 8], I32))


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("mode, pre, nxt, message", [
    (7, 1, 0, "pre_tokens must be >= the last sequence's Skv=4"),
    (7, 8, 1, "next_tokens must be in \\[0, 0\\]"),
    (8, 2, 0, "pre_tokens must be >= the first sequence's Skv=4"),
    (4, -3, 1, "pre_tokens -3 < 0 needs next_tokens >= 3"),
])
def test_invalid_tokens_with_traced_lengths(backend, mode, pre, nxt, message):
    fn = varlen(mode, pre_tokens=pre, next_tokens=nxt)
    with pytest.raises(Exception, match=message):
        run(backend, fn, jnp.asarray([4, 8], I32), jnp.asarray([4, 8], I32))


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
@pytest.mark.parametrize("prefix, message", [([5], "prefix\\[0\\] must be in \\[0, 4\\]"),
                                             ([-1], "prefix\\[0\\] must be in \\[0, 4\\]")])
def test_traced_prefix_out_of_range_raises(backend, grad, prefix, message):
    require_backend(backend)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
    f = lambda q, p: jr.flash_attention_score(q, q, q, sparse_mode=6, prefix=p)[0]
    if grad:
        f = jax.grad(lambda q, p: jnp.sum(jr.flash_attention_score(q, q, q, sparse_mode=6,
                                                                    prefix=p)[0]))
    with jr.backend(backend), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(f)(q, jnp.asarray(prefix, I32)))
    with jr.backend(backend):  # a valid traced prefix runs
        jax.block_until_ready(jax.jit(f)(q, jnp.asarray([2], I32)))


def test_traced_int64_positions_beyond_int32_raise():
    with jax.enable_x64(True):
        f = jax.jit(lambda p: jr.rope_cos_sin(p, 8)[0])
        with pytest.raises(Exception, match="positions values must fit in int32"):
            jax.block_until_ready(f(jnp.asarray([5, 2**32 + 5], jnp.int64)))
        np.testing.assert_allclose(np.asarray(f(jnp.asarray([5, 6], jnp.int64))),
                                   np.asarray(jr.rope_cos_sin(np.asarray([5, 6]), 8)[0]))


def test_vmap_checks_each_example():
    q, k, v = tnd()
    f = jax.jit(jax.vmap(lambda a, b: varlen()(q, k, v, a, b)[0]))
    good = jnp.asarray([[3, 8], [5, 8]], I32)
    assert f(good, good).shape == (2, 8, 2, 8)
    with pytest.raises(Exception, match=r"actual_seq_qlen must be non-decreasing.*\[5, 4\]"):
        jax.block_until_ready(f(jnp.asarray([[3, 8], [5, 4]], I32), good))


def test_checks_off_remove_the_callback_and_allow_export():
    q, k, v = tnd()
    f = jax.jit(lambda q, a, b: varlen()(q, k, v, a, b)[0])
    a = jnp.asarray([3, 8], I32)
    text_on = f.lower(q, a, a).as_text()
    assert "callback" in text_on
    with pytest.raises(ValueError, match=r"export inside `with jax_rope.runtime_checks\(False\):`"):
        jax.export.export(f, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                                              for t in jr.FFI_TARGETS])(q, a, a)
    with jr.runtime_checks(False):
        assert "callback" not in f.lower(q, a, a).as_text()
        exported = jax.export.export(f, disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(t) for t in jr.FFI_TARGETS])(q, a, a)
        np.testing.assert_allclose(np.asarray(exported.call(q, a, a)), np.asarray(f(q, a, a)),
                                   rtol=1e-6, atol=1e-6)
    assert "run-time checks: on" in jr.describe()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        jr.set_runtime_checks("off")
