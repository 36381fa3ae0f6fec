"""Installation facts: describe(), the info command, the backend switch, a pure
Python import without the compiled module, and jax.export of both paths."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr
from jax_rope.core import extension as _extension


def small_inputs():
    rng = np.random.default_rng(1)
    make = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return make((2, 4, 4, 8)), make((2, 4, 2, 8)), make((1, 4, 1, 8)), make((1, 4, 1, 8))


def test_describe_reports_version_extension_and_backends():
    text = jr.describe()
    assert jr.__version__ in text
    assert "extension: loaded" in text
    assert "cpu: XLA FFI kernel" in text
    assert "NPU runtime: absent" in text
    info = jr.describe(as_dict=True)
    assert info["jax_rope"] == jr.__version__ and info["jax"] == jax.__version__
    assert set(jr.FFI_TARGETS) == set(_extension.STATUS.targets)


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "jax_rope", "info"], capture_output=True,
                         text=True, check=True).stdout
    assert f"jax_rope {jr.__version__}" in out and "extension: loaded" in out


def test_import_without_extension_uses_fallback_and_says_so():
    code = (
        "import jax.numpy as jnp, jax_rope as jr\n"
        "print(jr.describe())\n"
        "q = jnp.ones((1, 2, 2, 4)); c = jnp.ones((1, 2, 1, 4))\n"
        "out = jr.apply_rotary_pos_emb(q, q, c, c)\n"
        "print('sum', float(out[0].sum()))\n"
        "try:\n"
        "    with jr.backend('ffi'): jr.apply_rotary_pos_emb(q, q, 2 * c, c)\n"
        "except ValueError as e: print('ffi error:', e)\n")
    env = dict(os.environ, JAX_ROPE_DISABLE_EXTENSION="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert "extension: not loaded (disabled by JAX_ROPE_DISABLE_EXTENSION)" in out
    assert "cpu: jnp fallback" in out
    # x = c = s = 1: the first half gives 1 - 1, the second 1 + 1; 4 rows of 4.
    assert "sum 16.0" in out
    assert "ffi error: backend 'ffi' was requested but the compiled extension is not loaded" in out


def test_environment_variable_sets_default_backend():
    code = "import jax_rope as jr; print(jr.describe(as_dict=True)['backend'])"
    env = dict(os.environ, JAX_ROPE_BACKEND="fallback")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out.strip() == "fallback"


def test_backend_change_retraces_jitted_function():
    q, k, c, s = small_inputs()
    fn = jax.jit(lambda q, k, c, s: jr.apply_rotary_pos_emb(q, k, c, s))
    with jr.backend("ffi"):
        assert "jax_rope_rope_fwd" in fn.lower(q, k, c, s).as_text()
    with jr.backend("fallback"):
        assert "jax_rope_rope_fwd" not in fn.lower(q, k, c, s).as_text()
        fallback = fn(q, k, c, s)
    with jr.backend("ffi"):
        kernel = fn(q, k, c, s)
    np.testing.assert_allclose(np.asarray(kernel[0]), np.asarray(fallback[0]), atol=1e-6)


def test_set_backend_validates_and_applies():
    with pytest.raises(ValueError, match="backend must be one of"):
        jr.set_backend("gpu")
    try:
        jr.set_backend("fallback")
        assert jr.describe(as_dict=True)["backend"] == "fallback"
    finally:
        jr.set_backend("auto")


@pytest.mark.parametrize("name", ["ffi", "fallback"])
def test_export_round_trip(name):
    q, k, c, s = small_inputs()

    def step(q, k, c, s):
        (qo, ko), pullback = jax.vjp(jr.apply_rotary_pos_emb, q, k, c, s)
        return qo, ko, pullback((qo, ko))

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in jr.FFI_TARGETS]
    with jr.backend(name):
        exported = jax.export.export(jax.jit(step), disabled_checks=checks)(q, k, c, s)
        expected = jax.jit(step)(q, k, c, s)
    text = exported.mlir_module()
    assert ("jax_rope_rope_fwd" in text) == (name == "ffi")
    # (serialize() would need the optional flatbuffers package; call() runs the
    # exported StableHLO itself.)
    for got, want in zip(jax.tree.leaves(exported.call(q, k, c, s)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_ffi_backend_on_platform_without_kernel_is_an_error():
    q, k, c, s = small_inputs()
    with jr.backend("ffi"):
        with pytest.raises(ValueError, match="no kernel for platform 'cuda'"):
            jax.export.export(jax.jit(jr.apply_rotary_pos_emb), platforms=["cuda"])(q, k, c, s)
    with jr.backend("auto"):
        exported = jax.export.export(jax.jit(jr.apply_rotary_pos_emb), platforms=["cuda"])(
            q, k, c, s)
    assert "custom_call" not in exported.mlir_module()
