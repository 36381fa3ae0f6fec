"""RoPE with donated inputs (README "Donating query and key"): `in_place=True` aliases the CPU
kernel's outputs to query and key, so a jit that donates them works in place. Checked: results
against the float64 oracle, donated inputs deleted as JAX documents, the kernel really writing
into the donated buffers, undonated inputs left intact, and grad/vmap unaffected."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr
from conftest import BACKENDS, require_backend
from helpers import assert_forward_matches, make_inputs, rng_for

CASES = [  # layout, mode, dtype, D, r (r < D: the untouched tail is kept in place too)
    ("BSND", "half", "float32", 16, 16),
    ("BSND", "half", "float32", 16, 8),
    ("BNSD", "interleave", "float32", 8, 8),
    ("TND", "quarter", "float32", 16, 8),
    ("SBND", "half", "bfloat16", 16, 16),
    ("BSND", "interleave", "float16", 8, 4),
    # 16-bit rows rotated straight in storage, whole vectors of pairs (h >= 16)
    ("BSND", "half", "bfloat16", 128, 128),
    ("BNSD", "quarter", "float16", 128, 96),
]


def _inputs(layout, mode, dtype, D, r):
    inputs = make_inputs(rng_for(layout, mode, dtype, D, r), layout, dtype, B=2, S=5, Nq=4,
                         Nk=2, D=D, r=r, cos_batch_one=True)
    # Owned device buffers (jnp.asarray of NumPy memory may alias it on CPU).
    arrays = [jnp.asarray(inputs[n]).copy() for n in ("query", "key", "cos", "sin")]
    return inputs, arrays


def _rope(layout, mode, in_place):
    return lambda q, k, c, s: jr.apply_rotary_pos_emb(q, k, c, s, layout=layout,
                                                      rotary_mode=mode, in_place=in_place)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("layout,mode,dtype,D,r", CASES)
def test_donated_inputs(backend, in_place, layout, mode, dtype, D, r):
    require_backend(backend)
    inputs, (q, k, c, s) = _inputs(layout, mode, dtype, D, r)
    pointers = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
    with jr.backend(backend):
        out = jax.jit(_rope(layout, mode, in_place), donate_argnums=(0, 1))(q, k, c, s)
    assert q.is_deleted() and k.is_deleted()
    assert not c.is_deleted() and not s.is_deleted()
    assert_forward_matches(out, inputs, layout, mode, dtype)
    if backend == "ffi" and in_place:  # the kernel wrote into the donated buffers
        assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_without_donation_keeps_inputs(backend):
    require_backend(backend)
    inputs, (q, k, c, s) = _inputs("BSND", "half", "float32", 16, 8)
    with jr.backend(backend):
        out = jax.jit(_rope("BSND", "half", True))(q, k, c, s)
    assert_forward_matches(out, inputs, "BSND", "half", "float32")
    np.testing.assert_array_equal(np.asarray(q), inputs["query"])
    np.testing.assert_array_equal(np.asarray(k), inputs["key"])


def test_in_place_lowers_to_an_aliased_custom_call():
    require_backend("ffi")
    _, args = _inputs("BSND", "half", "float32", 16, 16)
    with jr.backend("ffi"):
        aliased = jax.jit(_rope("BSND", "half", True)).lower(*args).as_text()
        fresh = jax.jit(_rope("BSND", "half", False)).lower(*args).as_text()
    assert "output_operand_aliases" in aliased
    assert "output_operand_aliases" not in fresh


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_under_grad_and_vmap(backend):
    require_backend(backend)
    _, (q, k, c, s) = _inputs("BSND", "half", "float32", 16, 16)
    loss = lambda in_place: lambda q, k, c, s: sum(
        jnp.sum(o ** 2) for o in _rope("BSND", "half", in_place)(q, k, c, s))
    with jr.backend(backend):
        grads = [jax.jit(jax.grad(loss(p), argnums=(0, 1, 2, 3)))(q, k, c, s)
                 for p in (True, False)]
        mapped = [jax.jit(jax.vmap(_rope("BSND", "half", p), in_axes=(0, 0, None, None)))(
            q[None], k[None], c, s) for p in (True, False)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(*mapped):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_place_must_be_a_bool():
    _, (q, k, c, s) = _inputs("BSND", "half", "float32", 16, 16)
    with pytest.raises(TypeError, match="in_place must be a bool"):
        jr.apply_rotary_pos_emb(q, k, c, s, in_place=1)
