"""apply_rotary_pos_emb under JAX transformations: jit, vmap (various in_axes, nested),
vmap of grad, checkpoint, lax.scan, jax.export, and what each backend lowers to."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_rope as jr
import rope_oracle as oracle
from conftest import require_backend
from helpers import (DTYPES, GRAD_TOL, args_of, assert_close, assert_forward_matches, f64,
                     make_inputs, rng_for)


def fwd(layout="BSND", mode="half"):
    return functools.partial(jr.apply_rotary_pos_emb, layout=layout, rotary_mode=mode)


def ref(q, k, c, s, layout="BSND", mode="half"):
    return oracle.apply_rotary_pos_emb(f64(q), f64(k), f64(c), f64(s), layout, mode)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout,mode", [("BSND", "half"), ("TND", "interleave"),
                                         ("BNSD", "quarter")])
def test_jit(backend, layout, mode, dtype):
    inp = make_inputs(rng_for("jit", layout, mode, dtype), layout, dtype, B=2, S=3, Nq=4, Nk=2,
                      D=16, r=8)
    out = jax.jit(fwd(layout, mode))(*args_of(inp))
    assert_forward_matches(out, inp, layout, mode, dtype)
    # static arguments through jit's static_argnames
    out2 = jax.jit(jr.apply_rotary_pos_emb, static_argnames=("layout", "rotary_mode"))(
        *args_of(inp), layout=layout, rotary_mode=mode)
    for a, b in zip(out, out2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def stack_ref(qs, ks, cs, ss, layout, mode="half"):
    """Oracle applied slice by slice over a leading vmapped axis (already moved to 0)."""
    outs = [ref(q, k, c, s, layout, mode) for q, k, c, s in zip(qs, ks, cs, ss)]
    return np.stack([o[0] for o in outs]), np.stack([o[1] for o in outs])


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_vmap_query_key_only(backend, mode):
    """in_axes (0, 0, None, None): a batch of q/k sharing one cos/sin table."""
    rng = rng_for("vmap0", mode)
    V = 3
    inps = [make_inputs(rng, "BSND", "float32", B=2, S=3, Nq=2, Nk=1, D=8, r=4,
                        cos_batch_one=True) for _ in range(V)]
    q = np.stack([i["query"] for i in inps])
    k = np.stack([i["key"] for i in inps])
    c, s = inps[0]["cos"], inps[0]["sin"]
    got = jax.vmap(fwd("BSND", mode), in_axes=(0, 0, None, None))(q, k, c, s)
    exp = stack_ref(q, k, [c] * V, [s] * V, "BSND", mode)
    for g, e in zip(got, exp):
        assert_close(g, e, np.float32)


def test_vmap_nonzero_axes_sbnd(backend):
    """in_axes (1, 1, 0, 0) with SBND: the mapped axis sits at 1 in q/k and at 0 in cos/sin."""
    rng = rng_for("vmap1")
    V, S, B, N, D = 2, 3, 2, 2, 8
    q = helpers.random_array(rng, (S, V, B, N, D), np.float32)
    k = helpers.random_array(rng, (S, V, B, 1, D), np.float32)
    c = helpers.random_array(rng, (V, S, 1, 1, D), np.float32, "trig")
    s = helpers.random_array(rng, (V, S, 1, 1, D), np.float32, "trig")
    got = jax.vmap(fwd("SBND"), in_axes=(1, 1, 0, 0))(q, k, c, s)
    exp = stack_ref(np.moveaxis(q, 1, 0), np.moveaxis(k, 1, 0), c, s, "SBND")
    for g, e in zip(got, exp):
        assert g.shape == e.shape  # out_axes=0
        assert_close(g, e, np.float32)
    got_out1 = jax.vmap(fwd("SBND"), in_axes=(1, 1, 0, 0), out_axes=1)(q, k, c, s)
    np.testing.assert_array_equal(np.asarray(got_out1[0]), np.moveaxis(np.asarray(got[0]), 0, 1))


def test_vmap_cos_sin_only(backend):
    """in_axes (None, None, 0, 0): one q/k rotated by a batch of tables."""
    rng = rng_for("vmapcs")
    V = 3
    inp = make_inputs(rng, "BNSD", "float32", B=2, S=3, Nq=2, Nk=2, D=8, r=8)
    c = helpers.random_array(rng, (V,) + inp["cos"].shape, np.float32, "trig")
    s = helpers.random_array(rng, (V,) + inp["sin"].shape, np.float32, "trig")
    got = jax.vmap(fwd("BNSD"), in_axes=(None, None, 0, 0))(inp["query"], inp["key"], c, s)
    exp = stack_ref([inp["query"]] * V, [inp["key"]] * V, c, s, "BNSD")
    for g, e in zip(got, exp):
        assert_close(g, e, np.float32)


def test_vmap_mixed_axes_tnd(backend):
    """in_axes (2, None, 0, None): q mapped on its last axis (moved), key and sin shared."""
    rng = rng_for("vmapmix")
    V, T, N, D = 2, 5, 3, 8
    q = helpers.random_array(rng, (T, N, V, D), np.float32)  # mapped axis 2
    k = helpers.random_array(rng, (T, 1, D), np.float32)
    c = helpers.random_array(rng, (V, T, 1, D), np.float32, "trig")
    s = helpers.random_array(rng, (T, 1, D), np.float32, "trig")
    got = jax.vmap(fwd("TND"), in_axes=(2, None, 0, None))(q, k, c, s)
    exp = stack_ref(np.moveaxis(q, 2, 0), [k] * V, c, [s] * V, "TND")
    for g, e in zip(got, exp):
        assert_close(g, e, np.float32)


def test_nested_vmap(backend):
    """Outer vmap over everything, inner vmap over q/k only."""
    rng = rng_for("nested")
    W, V = 2, 3
    B, S, N, D = 2, 3, 2, 8
    q = helpers.random_array(rng, (W, V, B, S, N, D), np.float32)
    k = helpers.random_array(rng, (W, V, B, S, 1, D), np.float32)
    c = helpers.random_array(rng, (W, 1, S, 1, 4), np.float32, "trig")
    s = helpers.random_array(rng, (W, 1, S, 1, 4), np.float32, "trig")
    inner = jax.vmap(fwd("BSND"), in_axes=(0, 0, None, None))
    got = jax.vmap(inner, in_axes=(0, 0, 0, 0))(q, k, c, s)
    for w in range(W):
        exp = stack_ref(q[w], k[w], [c[w]] * V, [s[w]] * V, "BSND")
        for g, e in zip(got, exp):
            assert_close(np.asarray(g)[w], e, np.float32)
    got_jit = jax.jit(jax.vmap(inner))(q, k, c, s)
    for a, b in zip(got, got_jit):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_vmap_low_precision(backend):
    rng = rng_for("vmaplp")
    V = 2
    inps = [make_inputs(rng, "SBND", "bfloat16", B=2, S=3, Nq=2, Nk=2, D=8) for _ in range(V)]
    stacked = {n: np.stack([i[n] for i in inps]) for n in helpers.ARG_NAMES}
    got = jax.vmap(fwd("SBND", "quarter"))(*args_of(stacked))
    for v in range(V):
        assert_forward_matches([np.asarray(g)[v] for g in got], inps[v], "SBND", "quarter",
                               "bfloat16")


def loss_fn(layout):
    def loss(q, k, c, s, wq, wk):
        qo, ko = jr.apply_rotary_pos_emb(q, k, c, s, layout=layout)
        return jnp.sum(qo * wq) + jnp.sum(ko * wk)
    return loss


def test_vmap_of_grad(backend):
    rng = rng_for("vmapgrad")
    V = 3
    base = make_inputs(rng, "BSND", "float32", B=2, S=3, Nq=4, Nk=2, D=8, r=4,
                       cos_batch_one=True)
    q = helpers.random_array(rng, (V,) + base["query"].shape, np.float32)
    k = helpers.random_array(rng, (V,) + base["key"].shape, np.float32)
    wq = helpers.random_array(rng, q.shape, np.float32)
    wk = helpers.random_array(rng, k.shape, np.float32)
    g = jax.vmap(jax.grad(loss_fn("BSND"), argnums=(0, 1, 2, 3)),
                 in_axes=(0, 0, None, None, 0, 0))(q, k, base["cos"], base["sin"], wq, wk)
    for v in range(V):
        exp = oracle.apply_rotary_pos_emb_grad(wq[v], wk[v], base["cos"], base["sin"], q[v], k[v],
                                               "BSND")
        for name, got_i, exp_i in zip(("dq", "dk", "dcos", "dsin"), g, exp):
            assert_close(np.asarray(got_i)[v], exp_i, np.float32, tol=GRAD_TOL, err_msg=name)


def test_vmap_of_grad_function(backend):
    """vmap over apply_rotary_pos_emb_grad itself, cotangents batched, tables shared."""
    rng = rng_for("vmapgradfn")
    V = 2
    base = make_inputs(rng, "TND", "float32", B=1, S=4, Nq=2, Nk=1, D=8, r=8)
    gq = helpers.random_array(rng, (V,) + base["query"].shape, np.float32)
    gk = helpers.random_array(rng, (V,) + base["key"].shape, np.float32)
    f = functools.partial(jr.apply_rotary_pos_emb_grad, layout="TND")
    got = jax.vmap(lambda a, b, c, s, q, k: f(a, b, c, s, query=q, key=k),
                   in_axes=(0, 0, None, None, None, None))(
        gq, gk, base["cos"], base["sin"], base["query"], base["key"])
    for v in range(V):
        exp = oracle.apply_rotary_pos_emb_grad(gq[v], gk[v], base["cos"], base["sin"],
                                               base["query"], base["key"], "TND")
        for got_i, exp_i in zip(got, exp):
            assert_close(np.asarray(got_i)[v], exp_i, np.float32, tol=GRAD_TOL)


def test_checkpoint(backend):
    rng = rng_for("remat")
    inp = make_inputs(rng, "BNSD", "float32", B=2, S=3, Nq=2, Nk=2, D=8, cos_batch_one=True)
    wq = helpers.random_array(rng, inp["query"].shape, np.float32)
    wk = helpers.random_array(rng, inp["key"].shape, np.float32)
    loss = loss_fn("BNSD")
    g = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(*args_of(inp), wq, wk)
    exp = oracle.apply_rotary_pos_emb_grad(wq, wk, inp["cos"], inp["sin"], inp["query"],
                                           inp["key"], "BNSD")
    for got_i, exp_i in zip(g, exp):
        assert_close(got_i, exp_i, np.float32, tol=GRAD_TOL)
    out = jax.checkpoint(fwd("BNSD"))(*args_of(inp))
    assert_forward_matches(out, inp, "BNSD", "half", "float32")


def test_scan_over_layers(backend):
    """lax.scan applying one table per layer to a carried (q, k), forward and gradient."""
    rng = rng_for("scan")
    L = 3
    inp = make_inputs(rng, "BSND", "float32", B=2, S=3, Nq=2, Nk=1, D=8, r=4,
                      cos_batch_one=True)
    cs = helpers.random_array(rng, (L,) + inp["cos"].shape, np.float32, "trig")
    ss = helpers.random_array(rng, (L,) + inp["sin"].shape, np.float32, "trig")
    wq = helpers.random_array(rng, inp["query"].shape, np.float32)
    wk = helpers.random_array(rng, inp["key"].shape, np.float32)

    def layers(q, k, cs, ss):
        def body(carry, table):
            return fwd("BSND")(*carry, *table), None
        (q, k), _ = jax.lax.scan(body, (q, k), (cs, ss))
        return q, k

    def loss(q, k, cs, ss):
        qo, ko = layers(q, k, cs, ss)
        return jnp.sum(qo * wq) + jnp.sum(ko * wk)

    # oracle: forward layer by layer, then the adjoints in reverse
    qs, ks = [f64(inp["query"])], [f64(inp["key"])]
    for layer in range(L):
        q_next, k_next = ref(qs[-1], ks[-1], cs[layer], ss[layer])
        qs.append(q_next)
        ks.append(k_next)
    got = jax.jit(layers)(inp["query"], inp["key"], cs, ss)
    assert_close(got[0], qs[-1], np.float32)
    assert_close(got[1], ks[-1], np.float32)

    gq, gk = f64(wq), f64(wk)
    dcs, dss = np.zeros(cs.shape), np.zeros(ss.shape)
    for layer in reversed(range(L)):
        gq, gk, dcs[layer], dss[layer] = oracle.apply_rotary_pos_emb_grad(
            gq, gk, cs[layer], ss[layer], qs[layer], ks[layer], "BSND")
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(inp["query"], inp["key"], cs, ss)
    for name, got_i, exp_i in zip(("dq", "dk", "dcos", "dsin"), g, (gq, gk, dcs, dss)):
        assert_close(got_i, exp_i, np.float32, tol=GRAD_TOL, err_msg=name)


def _exports(inp, wq, wk):
    args = args_of(inp)
    with jr.backend("fallback"):
        exp_f = jax.export.export(jax.jit(fwd("BSND")))(*args)
        exp_g = jax.export.export(jax.jit(jax.grad(loss_fn("BSND"), argnums=(0, 1, 2, 3))))(
            *args, wq, wk)
    return exp_f, exp_g


def _export_inputs():
    rng = rng_for("export")
    inp = make_inputs(rng, "BSND", "float32", B=2, S=3, Nq=4, Nk=2, D=16, r=8,
                      cos_batch_one=True)
    wq = helpers.random_array(rng, inp["query"].shape, np.float32)
    wk = helpers.random_array(rng, inp["key"].shape, np.float32)
    return inp, wq, wk


def _check_exported(exp_f, exp_g, inp, wq, wk):
    args = args_of(inp)
    assert_forward_matches(exp_f.call(*args), inp, "BSND", "half", "float32")
    g = exp_g.call(*args, wq, wk)
    exp = oracle.apply_rotary_pos_emb_grad(wq, wk, inp["cos"], inp["sin"], inp["query"],
                                           inp["key"], "BSND")
    for got_i, exp_i in zip(g, exp):
        assert_close(got_i, exp_i, np.float32, tol=GRAD_TOL)


def test_export_fallback():
    """jax.export of a jitted forward and gradient under the fallback, then called (also with
    the ffi backend in force at call time: the exported module is self-contained)."""
    inp, wq, wk = _export_inputs()
    exp_f, exp_g = _exports(inp, wq, wk)
    assert not kernel_calls(exp_f.mlir_module())
    assert not kernel_calls(exp_g.mlir_module())
    _check_exported(exp_f, exp_g, inp, wq, wk)
    with jr.backend("auto"):
        _check_exported(exp_f, exp_g, inp, wq, wk)


def kernel_calls(text):
    """Lines of a StableHLO text that call a jax_rope kernel (location info aside)."""
    return [line for line in text.splitlines() if "custom_call" in line and "jax_rope" in line]


def _lowered_text(f, *args):
    return jax.jit(f).lower(*args).as_text()


def test_lowering_ffi_uses_custom_call():
    require_backend("ffi")
    inp = make_inputs(rng_for("lower"), "BSND", "float32", B=1, S=2, Nq=2, Nk=1, D=8)
    with jr.backend("ffi"):
        txt = _lowered_text(fwd("BSND"), *args_of(inp))
        gtxt = _lowered_text(jax.grad(loss_fn("BSND"), argnums=(0, 1, 2, 3)), *args_of(inp),
                             inp["query"], inp["key"])
    assert "custom_call" in txt
    assert "custom_call" in gtxt
    assert kernel_calls(txt) and kernel_calls(gtxt)


def test_lowering_fallback_has_no_kernel():
    inp = make_inputs(rng_for("lower"), "BSND", "float32", B=1, S=2, Nq=2, Nk=1, D=8)
    with jr.backend("fallback"):
        txt = _lowered_text(fwd("BSND"), *args_of(inp))
        gtxt = _lowered_text(jax.grad(loss_fn("BSND"), argnums=(0, 1, 2, 3)), *args_of(inp),
                             inp["query"], inp["key"])
    assert "jax_rope" not in txt
    assert "jax_rope" not in gtxt


def test_backend_choice_is_part_of_jit_cache():
    """One jitted function, called under each backend in turn, lowers for the backend in force
    and gives the same numbers."""
    require_backend("ffi")
    inp = make_inputs(rng_for("cache"), "BSND", "float32", B=2, S=3, Nq=2, Nk=2, D=8)
    f = jax.jit(fwd("BSND"))
    with jr.backend("fallback"):
        a = f(*args_of(inp))
        assert "jax_rope" not in f.lower(*args_of(inp)).as_text()
    with jr.backend("ffi"):
        b = f(*args_of(inp))
        assert "custom_call" in f.lower(*args_of(inp)).as_text()
    with jr.backend("fallback"):
        c = f(*args_of(inp))
    for x, y, z in zip(a, b, c):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z))


def test_backend_fixture_in_force(backend):
    """The backend fixture really switches the lowering (guards every parametrized test)."""
    inp = make_inputs(rng_for("fixture"), "TND", "float32", B=1, S=2, Nq=1, Nk=1, D=4)
    txt = _lowered_text(fwd("TND"), *args_of(inp))
    assert bool(kernel_calls(txt)) == (backend == "ffi"), txt


def test_auto_backend_uses_kernel_on_cpu():
    """"auto" lowers to the compiled kernel on cpu when the extension is built."""
    require_backend("ffi")
    inp = make_inputs(rng_for("auto"), "BSND", "float32", B=1, S=2, Nq=1, Nk=1, D=4)
    with jr.backend("auto"):
        txt = _lowered_text(fwd("BSND"), *args_of(inp))
    if jax.default_backend() == "cpu":
        assert kernel_calls(txt)


@pytest.mark.parametrize("name", ["fallback", "ffi"])
def test_backend_environment_variable(name):
    """JAX_ROPE_BACKEND chooses the backend in a fresh process."""
    import os
    import subprocess
    import sys
    if name == "ffi":
        require_backend("ffi")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import jax, jax.numpy as jnp, jax_rope as jr\n"
        "x = jnp.ones((1, 2, 1, 4), jnp.float32)\n"
        "t = jax.jit(jr.apply_rotary_pos_emb).lower(x, x, x, x).as_text()\n"
        "print(any('custom_call' in l and 'jax_rope' in l for l in t.splitlines()))\n")
    env = dict(os.environ, JAX_ROPE_BACKEND=name,
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(name == "ffi")


@pytest.mark.parametrize("name", ["ffi", "fallback"])
def test_jitted_call_validates_shapes_once(name):
    """Trace-time validation runs once per call: the public function checks, abstract
    evaluation and lowering (partitioned wrapper, local primitive) only infer shapes."""
    import sys

    from jax_rope.rope import options as rope_options
    require_backend(name)
    q, k, c, s = (jnp.ones(x) for x in ((2, 8, 4, 16), (2, 8, 2, 16), (1, 8, 1, 16),
                                         (1, 8, 1, 16)))
    calls = []
    code = rope_options.check_rope_shapes.__code__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(frame.f_code.co_name)

    fn = jax.jit(lambda *a: jr.apply_rotary_pos_emb(*a))
    with jr.backend(name):
        sys.setprofile(profile)
        try:
            fn.lower(q, k, c, s)
        finally:
            sys.setprofile(None)
    assert calls == ["check_rope_shapes"]
