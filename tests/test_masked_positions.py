"""Masked positions have no influence, exactly, on both backends, forward and backward:
NaN or Inf in a key or value row that a query row cannot see (masked by its sparse mode, in
another TND sequence, in TND padding beyond the last cumulative length) leaves that row's
output and gradient, and the gradients of the key/value rows only such rows see, bit for bit
as they are when the poisoned row holds 0. A poisoned row a query row does see still reaches
it (the user's data)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_rope as jr
from conftest import require_backend

BACKENDS = ["ffi", "fallback"]


@pytest.fixture(autouse=True, scope="module")
def compiled_as_users_compile():
    """XLA optimises these programs as it does by default (conftest.py turns most of that off
    for the rest of the suite): NaN must have no influence in the code users run."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


def evaluator(backend, call, weights):
    """(q, k, v) -> output and (dq, dk, dv) of sum(out * weights), jitted once."""
    loss = lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32) * weights)
    with jr.backend(backend):
        fwd, grad = jax.jit(call), jax.jit(jax.grad(loss, (0, 1, 2)))

    def evaluate(q, k, v):
        with jr.backend(backend):
            return [np.asarray(x) for x in (fwd(q, k, v),) + tuple(grad(q, k, v))]
    return evaluate


def check_no_influence(backend, call, q, k, v, visible, axis, rows, poisons):
    """visible: bool (Sq, Skv) over the token axis `axis` of q and k/v; for each (target,
    value) of `poisons`, `rows` of target ("key" or "value") hold 0 in the baseline and
    `value` in the poisoned call."""
    require_backend(backend)
    rng = np.random.default_rng(7)
    weights = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]), jnp.float32)
    evaluate = evaluator(backend, call, weights)
    index = (slice(None),) * axis + (np.asarray(rows),)
    for target, poison in poisons:
        clean, poisoned = ({"key": k, "value": v}[target].at[index].set(x)
                           for x in (0.0, poison))
        args = lambda x: (q, x, v) if target == "key" else (q, k, x)
        blind = _compare(evaluate(*args(clean)), evaluate(*args(poisoned)), visible, axis,
                         rows)
    return blind


def _compare(base, got, visible, axis, rows):
    blind = ~visible[:, rows].any(axis=1)  # query rows that see no poisoned row
    unaffected_keys = ~visible[~blind].any(axis=0)  # key rows only blind rows see
    unaffected_keys[rows] = False
    take = lambda x, sel: np.take(x, np.flatnonzero(sel), axis=axis)
    for name, b, g in (("out", base[0], got[0]), ("dquery", base[1], got[1])):
        np.testing.assert_array_equal(take(g, blind), take(b, blind), err_msg=name)
    for name, b, g in (("dkey", base[2], got[2]), ("dvalue", base[3], got[3])):
        np.testing.assert_array_equal(take(g, unaffected_keys), take(b, unaffected_keys),
                                      err_msg=name)
    if (~blind).any():  # the poison does reach the rows that see it: the check can fail
        assert not np.isfinite(take(got[0], ~blind)).all()
    return blind


def normal(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


PADDED = [  # (sparse_mode, kwargs, Sq, Skv, poisoned key rows)
    (2, {}, 80, 80, [70]),
    (3, {}, 70, 90, [75, 89]),
    (4, dict(pre_tokens=20, next_tokens=3), 96, 96, [10, 64]),
    (6, dict(prefix=[20]), 72, 80, [40]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, kw, sq, skv, rows", PADDED, ids=[str(c[0]) for c in PADDED])
def test_padded_modes(backend, mode, kw, sq, skv, rows):
    q, k, v = normal((1, sq, 2, 16), 0), normal((1, skv, 1, 16), 1), normal((1, skv, 1, 16), 2)
    call = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=mode, **kw)[0]
    visible = ~np.asarray(jr.sparse_mask(mode, sq, skv, **kw))[0]
    blind = check_no_influence(backend, call, q, k, v, visible, 1, rows,
                               [("value", np.nan), ("key", np.nan), ("value", np.inf)])
    assert blind.any() and (~blind).any()


TND = [  # (sparse_mode, kwargs, actual_seq_qlen, actual_seq_kvlen, Tq, Tkv, poisoned rows)
    (3, {}, [30, 100], [40, 110], 104, 116, [35, 60]),  # other sequence; padding rows
    (3, {}, [30, 100], [40, 110], 104, 116, [112, 115]),  # padding only: nobody sees it
    (7, dict(pre_tokens=95, next_tokens=-5), [30, 100], [40, 130], 100, 130, [120]),
    (8, dict(pre_tokens=40, next_tokens=2), [30, 100], [40, 110], 100, 110, [20]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, kw, qlen, kvlen, tq, tkv, rows", TND,
                         ids=["3-other-sequence", "3-padding", "7", "8"])
def test_packed_tnd(backend, mode, kw, qlen, kvlen, tq, tkv, rows):
    q, k, v = normal((tq, 2, 16), 3), normal((tkv, 2, 16), 4), normal((tkv, 2, 16), 5)
    call = lambda q, k, v: jr.flash_attention_score(
        q, k, v, input_layout="TND", sparse_mode=mode, actual_seq_qlen=qlen,
        actual_seq_kvlen=kvlen, **kw)[0]
    visible = ~np.asarray(jr.sparse_mask(mode, tq, tkv, actual_seq_qlen=qlen,
                                         actual_seq_kvlen=kvlen, **kw))
    check_no_influence(backend, call, q, k, v, visible, 0, rows,
                       [("key", np.nan), ("value", np.nan)])


@settings(max_examples=6, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("backend", BACKENDS)
def test_property_masked_positions_have_no_influence(backend, data):
    sq = data.draw(st.integers(1, 90), label="Sq")
    skv = data.draw(st.integers(1, 90), label="Skv")
    mode = data.draw(st.sampled_from([0, 1, 2, 3, 4]), label="sparse_mode")
    kw = {}
    if mode in (0, 1):  # a random element mask (True = masked)
        seed = data.draw(st.integers(0, 2**16), label="mask seed")
        kw["atten_mask"] = np.random.default_rng(seed).random((sq, skv)) < 0.5
    if mode == 4:
        kw.update(pre_tokens=skv + 1, next_tokens=data.draw(st.integers(0, 4), label="next"))
    rows = sorted(set(data.draw(st.lists(st.integers(0, skv - 1), min_size=1, max_size=3),
                                label="poisoned rows")))
    target = data.draw(st.sampled_from(["key", "value"]), label="target")
    poison = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="poison")
    q, k, v = normal((1, sq, 2, 8), sq), normal((1, skv, 2, 8), skv), normal((1, skv, 2, 8), 9)
    call = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=mode, **kw)[0]
    visible = ~np.asarray(jr.sparse_mask(mode, sq, skv, **kw))[0]
    check_no_influence(backend, call, q, k, v, visible, 1, rows, [(target, poison)])


QUERY_SIDE = [  # (sparse_mode, kwargs, S, poisoned query rows)
    (2, {}, 200, [3, 130]),  # in the diagonal tiles of two query blocks
    (4, dict(pre_tokens=20, next_tokens=3), 96, [10, 64]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", ["query", "dout"])
@pytest.mark.parametrize("mode, kw, s, rows", QUERY_SIDE, ids=["2", "4"])
def test_poisoned_query_rows_reach_only_the_keys_they_see(backend, target, mode, kw, s, rows):
    """NaN in a query row, or in the gradient of its output, reaches the key and value
    gradients of the keys that row sees and no others: theirs stay finite and as they are
    when the row holds 0 (bit for bit in the fallback; in the kernels up to rounding, as a
    non-finite row changes how its 64-row query block keeps its softmax shifts)."""
    require_backend(backend)
    q, k, v, dout = (normal((1, s, 2, 16), seed) for seed in range(4))
    call = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=mode, **kw)[0]
    index = (slice(None), np.asarray(rows))

    def run(x):  # out, dquery, dkey, dvalue with the rows set to x
        if target == "query":
            return evaluator(backend, call, dout)(q.at[index].set(x), k, v)
        return evaluator(backend, call, dout.at[index].set(x))(q, k, v)
    base, got = run(0.0), run(np.nan)
    visible = ~np.asarray(jr.sparse_mask(mode, s, s, **kw))[0]
    seen = visible[rows].any(axis=0)  # keys some poisoned row sees
    for name, b, g in (("dkey", base[2], got[2]), ("dvalue", base[3], got[3])):
        assert not np.isfinite(g[:, seen]).all(), name  # the poison does arrive: can fail
        assert np.isfinite(g[:, ~seen]).all(), name
        if backend == "fallback":
            np.testing.assert_array_equal(g[:, ~seen], b[:, ~seen], err_msg=name)
        else:
            np.testing.assert_allclose(g[:, ~seen], b[:, ~seen], rtol=1e-5, atol=1e-6,
                                       err_msg=name)


POISONS = [  # (target, poisoned rows, poison)
    ("query", [3, 130], np.nan), ("key", [20, 150], np.nan), ("key", [150], np.inf),
    ("value", [40], np.nan), ("value", [40], np.inf), ("dout", [100], np.nan)]


@pytest.mark.parametrize("target, rows, poison", POISONS,
                         ids=[f"{t}-{r[0]}-{p}" for t, r, p in POISONS])
@pytest.mark.parametrize("sq, skv, mode", [(200, 200, 2), (3, 1100, 3)],
                         ids=["blocks", "decode"])
def test_rows_reached_by_nan_are_nan_alike_on_both_backends(target, rows, poison, sq, skv, mode):
    """Where a NaN or Inf reaches a row's scores, its output, softmax_max and softmax_sum
    are NaN (never the statistics of a dead row, nor a max XLA's reduction happened to take
    from the other scores), and its gradient reaches every key it sees: the kernels and the
    fallback give NaN at the same elements of every output and gradient."""
    for backend in BACKENDS:
        require_backend(backend)
    rows = sorted({min(r, (sq if target in ("query", "dout") else skv) - 1) for r in rows})
    q = normal((1, sq, 4, 16), 0)
    k, v = normal((1, skv, 2, 16), 1), normal((1, skv, 2, 16), 2)
    dout = normal((1, sq, 4, 16), 3)
    index = (slice(None), np.asarray(rows))
    args = dict(query=q, key=k, value=v, dout=dout)
    args[target] = args[target].at[index].set(poison)
    call = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=mode)

    def run(q, k, v, dout):
        return tuple(call(q, k, v)) + jax.vjp(lambda *a: call(*a)[0], q, k, v)[1](dout)
    results = {}
    for backend in BACKENDS:
        with jr.backend(backend):
            results[backend] = [np.asarray(x) for x in jax.jit(run)(
                args["query"], args["key"], args["value"], args["dout"])]
    names = ["out", "softmax_max", "softmax_sum", "dquery", "dkey", "dvalue"]
    for name, a, b in zip(names, results["ffi"], results["fallback"]):
        # (an Inf that products reach stays Inf in the kernels, the fallback makes it NaN)
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)
    for backend in BACKENDS:
        _, smax, ssum = results[backend][:3]
        np.testing.assert_array_equal(np.isnan(smax), np.isnan(ssum), err_msg=backend)
        np.testing.assert_array_equal(np.isnan(ssum), ~np.isfinite(ssum), err_msg=backend)
    if target in ("query", "key"):
        assert np.isnan(ssum).any()  # the poison reached some row: the check can fail
