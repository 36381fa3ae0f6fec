"""Run on 8 simulated CPU devices (the environment must set XLA_FLAGS first):
sharded RoPE/attention equal the unsharded result with no gathering collectives, and
context-parallel attention equals flash_attention_score in value and gradient."""

import os
import sys

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_rope as jr  # noqa: E402

GATHERS = ("all-gather", "all-to-all", "collective-permute")


def _normal(key, shape):
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _no_gathers(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    found = [w for w in GATHERS if w in text]
    assert not found, f"compiled HLO contains {found}"


def check_rope(backend, mesh):
    b, s, nq, nk, d = 4, 8, 8, 4, 16
    q, k = _normal(0, (b, s, nq, d)), _normal(1, (b, s, nk, d))
    cos, sin = _normal(2, (1, s, 1, d)), _normal(3, (1, s, 1, d))
    gq, gk = _normal(4, q.shape), _normal(5, k.shape)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    spec = P("data", None, "model")
    with jr.backend(backend):
        fwd = lambda q, k, c, s: jr.apply_rotary_pos_emb(q, k, c, s)
        bwd = lambda gq, gk, c, s, q, k: jr.apply_rotary_pos_emb_grad(gq, gk, c, s, query=q, key=k)
        sharded = (put(q, spec), put(k, spec), put(cos, P()), put(sin, P()))
        for got, want in zip(jax.jit(fwd)(*sharded), fwd(q, k, cos, sin)):
            _close(got, want)
        _no_gathers(fwd, *sharded)
        sharded_b = (put(gq, spec), put(gk, spec)) + sharded[2:] + sharded[:2]
        for got, want in zip(jax.jit(bwd)(*sharded_b), bwd(gq, gk, cos, sin, q, k)):
            _close(got, want, 1e-4)
        _no_gathers(bwd, *sharded_b)  # dcos/dsin: an all-reduce only
        # TND: the token axis shards too; cos/sin (T, 1, r) follow it.
        qt, kt, ct = _normal(6, (32, 4, 8)), _normal(7, (32, 2, 8)), _normal(8, (32, 1, 8))
        tnd = lambda q, k, c: jr.apply_rotary_pos_emb(q, k, c, c, layout="TND")
        args = (put(qt, P(("data", "model"))), put(kt, P(("data", "model"))),
                put(ct, P(("data", "model"))))
        for got, want in zip(jax.jit(tnd)(*args), tnd(qt, kt, ct)):
            _close(got, want)
        _no_gathers(tnd, *args)
        # grad through vmap under sharding
        loss = lambda q, k: sum(jnp.sum(o ** 2) for o in jax.vmap(
            lambda q, k: jr.apply_rotary_pos_emb(q, k, cos[0], sin[0], layout="TND"))(q, k))
        got = jax.jit(jax.grad(loss, (0, 1)))(put(q, spec), put(k, spec))
        for g, w in zip(got, jax.grad(loss, (0, 1))(q, k)):
            _close(g, w, 1e-4)


def check_attention(backend, mesh):
    b, s, n1, n2, d = 4, 16, 8, 4, 8
    q, k, v = _normal(10, (b, s, n1, d)), _normal(11, (b, s, n2, d)), _normal(12, (b, s, n2, d))
    w = _normal(13, (b, s, n1, d))
    mask = jax.random.bernoulli(jax.random.PRNGKey(14), 0.3, (b, n1, s, s))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    spec = P("data", None, "model")
    cases = [dict(sparse_mode=2), dict(sparse_mode=4, pre_tokens=3, next_tokens=1), "mask"]
    with jr.backend(backend):
        for case in cases:
            kw = dict(sparse_mode=1) if case == "mask" else case

            def fwd(q, k, v, m):
                return jr.flash_attention_score(q, k, v, atten_mask=m if case == "mask" else None,
                                                **kw)

            def grads(q, k, v, m):
                f = lambda q, k, v: jnp.sum(fwd(q, k, v, m)[0] * w)
                return jax.grad(f, (0, 1, 2))(q, k, v)

            args = (put(q, spec), put(k, spec), put(v, spec), put(mask, P("data", "model")))
            for fn in (fwd, grads):
                for got, want in zip(jax.jit(fn)(*args), fn(q, k, v, mask)):
                    _close(got, want, 1e-4)
                _no_gathers(fn, *args)
        scores = lambda q, k: jr.attention_scores(q, k, sparse_mode=3)
        _close(jax.jit(scores)(put(q, spec), put(k, spec)), scores(q, k))
        _no_gathers(scores, put(q, spec), put(k, spec))
        # TND: heads shard, the packed tokens stay whole
        qt, kt = _normal(15, (12, n1, d)), _normal(16, (12, n2, d))
        tnd = lambda q, k, v: jr.flash_attention_score(
            q, k, v, input_layout="TND", sparse_mode=3, actual_seq_qlen=[5, 12],
            actual_seq_kvlen=[5, 12])
        hs = P(None, ("data", "model"))
        args = (put(qt, hs), put(kt, P(None, "model")), put(kt, P(None, "model")))
        for got, want in zip(jax.jit(tnd)(*args), tnd(qt, kt, kt)):
            _close(got, want)
        hs = P(None, "model")
        args = (put(qt, hs), put(kt, hs), put(kt, hs))
        _no_gathers(tnd, *args)


def check_bias_dropout(backend, mesh):
    """Batch and heads sharded: ALiBi, a full bias and dropout give the unsharded bits; the
    keep mask (read through the output: scale 0, value = identity rows) is
    jr.dropout_keep_mask's, drawn with global batch and head indices."""
    b, s, n1, n2 = 4, 16, 8, 4
    q, k = _normal(20, (b, s, n1, s)), _normal(21, (b, s, n2, s))
    eye = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None, :], (b, s, n2, s))
    slopes = jnp.linspace(0.1, 0.8, n1, dtype=jnp.float32)
    full = _normal(22, (b, n1, s, s))
    key = jax.random.key(7)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    spec = P("data", None, "model")
    with jr.backend(backend):
        def reveal(q, k, v):
            return jr.flash_attention_score(q, k, v, scale=0.0, keep_prob=0.75,
                                            dropout_key=key)[0]
        got = jax.jit(reveal)(put(q, spec), put(k, spec), put(eye, spec))
        keep = np.moveaxis(np.asarray(got) > 0, 2, 1)  # (B, N1, Sq, Skv)
        assert np.array_equal(keep, np.asarray(jr.dropout_keep_mask(key, 0.75, s, s, batch=b,
                                                                    heads=n1)))
        assert np.array_equal(np.asarray(got), np.asarray(reveal(q, k, eye)))
        w = _normal(23, (b, s, n1, s))

        def outputs(q, k, v, slopes, full):
            out1 = jr.flash_attention_score(q, k, v, pse=slopes, pse_type=2, sparse_mode=2,
                                            keep_prob=0.9, dropout_key=key)[0]
            out2 = jr.flash_attention_score(q, k, v, pse=full, pse_type=1, keep_prob=0.9,
                                            dropout_key=key)[0]
            return out1, out2

        def grads(*a):
            return jax.grad(lambda *a: sum(jnp.sum(o * w) for o in outputs(*a)),
                            (0, 1, 2, 3, 4))(*a)

        args = (put(q, spec), put(k, spec), put(eye, spec), put(slopes, P("model")),
                put(full, P("data", "model")))
        for got, want in zip(jax.jit(outputs)(*args), outputs(q, k, eye, slopes, full)):
            if backend == "ffi":  # the kernel computes each (b, n) alike: the same bits
                assert np.array_equal(np.asarray(got), np.asarray(want))
            else:  # XLA's dot may sum in another order for the local shapes
                _close(got, want)
        for got, want in zip(jax.jit(grads)(*args), grads(q, k, eye, slopes, full)):
            _close(got, want, 1e-4)


def check_context_parallel(backend, devices):
    mesh = jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices])
    b, s, n1, n2, d = 1, 4 * devices, 2, 1, 8
    q, k, v = _normal(20, (b, s, n1, d)), _normal(21, (b, s, n2, d)), _normal(22, (b, s, n2, d))
    w = _normal(23, (b, s, n1, d))
    cases = [("ring", True, dict(sparse_mode=2)), ("all_gather", True, dict(sparse_mode=3)),
             ("ring", False, dict(sparse_mode=0)),
             ("all_gather", False, dict(sparse_mode=4, pre_tokens=5, next_tokens=2)),
             ("ring", True, dict(sparse_mode=4, pre_tokens=3, next_tokens=-1))]
    with jr.backend(backend):
        for strategy, balance, kw in cases:
            want = jr.flash_attention_score(q, k, v, **kw)[0]
            want_g = jax.grad(lambda *a: jnp.sum(jr.flash_attention_score(*a, **kw)[0] * w),
                              (0, 1, 2))(q, k, v)
            cp = lambda q, k, v: jr.context_parallel_attention(
                q, k, v, mesh=mesh, seq_axis="seq", strategy=strategy, load_balance=balance, **kw)
            _close(jax.jit(cp)(q, k, v), want)
            got_g = jax.jit(jax.grad(lambda *a: jnp.sum(cp(*a) * w), (0, 1, 2)))(q, k, v)
            for g, h in zip(got_g, want_g):
                _close(g, h, 1e-4)
        if devices != 4:  # (compiling for 8 devices as well would add little)
            return
        # A NaN query row and a NaN key row (seen by the three rows after it in a band)
        # reach the elements they reach in the whole-sequence call: NaN at the same places
        # of the output and of every gradient, the others finite.
        loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
        args = (q.at[:, 1].set(jnp.nan), k.at[:, s - 4].set(jnp.nan), v)
        band = dict(sparse_mode=4, pre_tokens=3, next_tokens=0)
        whole = lambda q, k, v: jr.flash_attention_score(q, k, v, **band)[0]
        cp = lambda q, k, v: jr.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                           **band)
        want = (whole(*args),) + jax.grad(loss(whole), (0, 1, 2))(*args)
        got = (jax.jit(cp)(*args),) + jax.jit(jax.grad(loss(cp), (0, 1, 2)))(*args)
        for g, h in zip(got, want):
            np.testing.assert_array_equal(np.isnan(np.asarray(g)), np.isnan(np.asarray(h)))
            assert np.isnan(np.asarray(h)).any() and not np.isnan(np.asarray(h)).all()


def check_partitioned_on_platform(platform):
    """A RoPE and an attention call with batch sharded over 8 devices, lowered for `platform`:
    one partitioned region (CustomSPMDPartitioning) per call and no gathering collective. XLA
    runs the partition callback while compiling; for the NPU platform (no backend here) the
    callback recorded while compiling for CPU is lowered for the NPU, which shows the NPU
    kernel inside the region on batch-sharded operands."""
    from jax_rope import npu
    from jax_rope.core import partitioning
    npu.enable_lowering_without_device()
    mesh = jax.make_mesh((8,), ("data",))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    q = put(_normal(0, (8, 16, 4, 64)), P("data"))
    c = put(_normal(1, (8, 16, 1, 64)), P("data"))
    calls = {
        "rope": (lambda q, c: jr.apply_rotary_pos_emb(q, q, c, c), (q, c),
                 "jax_rope_rope_fwd", npu.ROPE_FWD),
        "attention": (lambda q, c: jr.flash_attention_score(q, q, q, sparse_mode=2)[0], (q, c),
                      "jax_rope_attention_fwd", npu.ATTENTION_FWD),
    }
    recorded = []
    original = partitioning._partition

    def record(static, mesh_, arg_shapes, result_shape):
        mesh_, lower_fn, result_shardings, arg_shardings = original(
            static, mesh_, arg_shapes, result_shape)
        recorded.append((lower_fn, arg_shapes, arg_shardings))
        return mesh_, lower_fn, result_shardings, arg_shardings

    partitioning._partition = record
    try:
        for name, (fn, args, cpu_target, npu_target) in calls.items():
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
            text = lowered.as_text()
            assert text.count("@CustomSPMDPartitioning") == 1, (name, platform, text)
            assert not [w for w in GATHERS if w.replace("-", "_") in text], (name, platform)
            recorded.clear()
            compiled = jax.jit(fn).lower(*args).compile().as_text()  # runs the callback
            assert not [w for w in GATHERS if w in compiled], (name, compiled)
            (lower_fn, arg_shapes, arg_shardings), = recorded
            for sharding in arg_shardings[0]:  # every operand stays split over batch
                assert sharding.spec[0] == "data", (name, sharding)
            local = [jax.ShapeDtypeStruct((a.shape[0] // 8,) + a.shape[1:], a.dtype)
                     for a in jax.tree.leaves(arg_shapes)]
            inner = jax.jit(lambda *xs: lower_fn(xs)).trace(*local).lower(
                lowering_platforms=(platform,)).as_text()
            target = cpu_target if platform == "cpu" else npu_target
            assert f"@{target}(" in inner, (name, platform, inner)
            if platform == "cpu":
                assert cpu_target in compiled, (name, "kernel not in the compiled program")
    finally:
        partitioning._partition = original


if __name__ == "__main__":
    which = sys.argv[1]
    if which.startswith("partitioned:"):
        check_partitioned_on_platform(which.split(":", 1)[1])
        print("ok", which)
        sys.exit(0)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    backends = ("ffi",) if which == "8" else ("ffi", "fallback")  # keep the suite short
    for backend in backends:
        if which == "sharding":
            check_rope(backend, mesh)
            check_attention(backend, mesh)
            check_bias_dropout(backend, mesh)
        else:
            check_context_parallel(backend, int(which))
    print("ok", which)
