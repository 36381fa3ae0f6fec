"""Pure NumPy test helpers: input shapes per layout, random inputs, dtype tolerances and
ulp comparisons, and the multi-device subprocess runner. No JAX and no jax_rope here, so ``test_rope_oracle.py`` runs without them."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np

import rope_oracle as oracle

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}

# Forward tolerances against the float64 oracle (float32), and for the looser gradient checks
# of reductions (dcos/dsin sum many terms) in every dtype: (rtol, atol relative to scale).
FWD_TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1e-2)}
GRAD_TOL = {"float32": (1e-5, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (2e-2, 2e-2)}


def layout_shapes(layout, B, S, Nq, Nk, D, r, cos_batch):
    """(query shape, key shape, cos/sin shape) for one layout; cos_batch is 1 or B.

    TND has no batch axis: T = B * S tokens and cos is (T, 1, r).
    """
    if layout in ("BSND", "BSH"):
        return (B, S, Nq, D), (B, S, Nk, D), (cos_batch, S, 1, r)
    if layout == "SBND":
        return (S, B, Nq, D), (S, B, Nk, D), (S, cos_batch, 1, r)
    if layout == "BNSD":
        return (B, Nq, S, D), (B, Nk, S, D), (cos_batch, 1, S, r)
    if layout == "TND":
        T = B * S
        return (T, Nq, D), (T, Nk, D), (T, 1, r)
    raise AssertionError(layout)


def random_array(rng, shape, dtype, kind="normal"):
    """Random values generated in float64 and rounded once to ``dtype`` (so low-precision
    inputs are exact low-precision numbers and the oracle sees their float64 upcast)."""
    if kind == "normal":
        a = rng.standard_normal(shape)
    else:  # cos/sin-like values
        a = rng.uniform(-1.0, 1.0, shape)
    return np.asarray(a).astype(np.dtype(dtype))


def make_inputs(rng, layout="BSND", dtype="float32", B=2, S=3, Nq=2, Nk=None, D=8, r=None,
                cos_batch_one=False):
    """Dict with query, key, cos, sin as NumPy arrays of ``dtype``."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    Nk = Nq if Nk is None else Nk
    r = D if r is None else r
    cb = 1 if cos_batch_one else B
    qs, ks, cs = layout_shapes(layout, B, S, Nq, Nk, D, r, cb)
    out = {
        "query": random_array(rng, qs, dt),
        "key": random_array(rng, ks, dt),
        "cos": random_array(rng, cs, dt, "trig"),
        "sin": random_array(rng, cs, dt, "trig"),
    }
    oracle.check_layout(out["query"], out["key"], out["cos"], out["sin"], layout)
    return out


def f64(a):
    return np.asarray(a).astype(np.float64)


def ordered_bits(a, dtype):
    """Map floats of ``dtype`` to integers whose difference is the distance in ulps."""
    dt = np.dtype(dtype)
    a = np.asarray(a).astype(dt)
    nbits = dt.itemsize * 8
    u = a.view(np.dtype(f"uint{nbits}")).astype(np.int64)
    sign = u >> (nbits - 1)
    mag = u & ((1 << (nbits - 1)) - 1)
    return np.where(sign == 1, -mag, mag)


def ulp_distance(a, b, dtype):
    return np.abs(ordered_bits(a, dtype) - ordered_bits(b, dtype))


def assert_within_ulp(actual, expected, dtype, ulps=1, err_msg=""):
    """actual (of dtype) is within ``ulps`` ulps of expected rounded once to dtype."""
    dt = np.dtype(dtype)
    actual = np.asarray(actual)
    assert actual.dtype == dt, (actual.dtype, dt)
    exp = np.asarray(expected).astype(dt)
    assert actual.shape == exp.shape, (actual.shape, exp.shape)
    assert np.all(np.isfinite(f64(actual))), err_msg
    dist = ulp_distance(actual, exp, dt)
    if dist.size and dist.max() > ulps:
        idx = np.unravel_index(np.argmax(dist), dist.shape)
        raise AssertionError(
            f"{err_msg}: {int(dist.max())} ulps > {ulps} at {idx}: got {f64(actual)[idx]!r}, "
            f"expected {f64(exp)[idx]!r} ({int((dist > ulps).sum())} of {dist.size} off)")


def assert_close(actual, expected, dtype, tol=FWD_TOL, err_msg=""):
    """Compare with rtol and an atol scaled by the size of the expected values."""
    name = np.dtype(dtype).name
    rtol, atol = tol[name]
    exp = f64(expected)
    scale = max(1.0, float(np.max(np.abs(exp)))) if exp.size else 1.0
    act = np.asarray(actual)
    assert act.shape == exp.shape, (act.shape, exp.shape, err_msg)
    np.testing.assert_allclose(f64(act), exp, rtol=rtol, atol=atol * scale, err_msg=err_msg)


def assert_forward_matches(actual, inputs, layout, mode, dtype):
    """Check (q_out, k_out) against the oracle in the spec's precision terms.

    float32: close to the float64 oracle. float16/bfloat16: within 1 ulp of the float64 oracle
    rounded once, and within 1 ulp of the spec's golden (float32 reference, then one cast).
    """
    dt = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    q_out, k_out = (np.asarray(a) for a in actual)
    ref = oracle.apply_rotary_pos_emb(*(f64(inputs[n]) for n in ("query", "key", "cos", "sin")),
                                      layout=layout, rotary_mode=mode)
    for name, got, exp, inp in (("q_out", q_out, ref[0], inputs["query"]),
                                ("k_out", k_out, ref[1], inputs["key"])):
        assert got.shape == inp.shape, (name, got.shape, inp.shape)
        assert got.dtype == dt, (name, got.dtype, dt)
        if dt == np.float32:
            assert_close(got, exp, dt, err_msg=name)
        else:
            assert_within_ulp(got, exp, dt, err_msg=f"{name} vs float64 oracle")
    if dt != np.float32:
        golden = oracle.apply_rotary_pos_emb(
            *(inputs[n] for n in ("query", "key", "cos", "sin")), layout=layout,
            rotary_mode=mode, dtype=np.float32)
        assert_within_ulp(q_out, golden[0], dt, err_msg="q_out vs float32 golden")
        assert_within_ulp(k_out, golden[1], dt, err_msg="k_out vs float32 golden")


ARG_NAMES = ("query", "key", "cos", "sin")


def args_of(inputs):
    return [inputs[n] for n in ARG_NAMES]


def rope_cases(modes=oracle.MODES, layouts=oracle.LAYOUTS, dtypes=("float32",)):
    """Hypothesis strategy for one random call: small shapes, partial rotary, GQA, cos batch 1
    or B. Returns a dict of make_inputs keyword arguments plus layout, mode and seed."""
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        mode = draw(st.sampled_from(modes))
        layout = draw(st.sampled_from(layouts))
        unit = 4 if mode == "quarter" else 2
        D = unit * draw(st.integers(1, 32 // unit))
        r = unit * draw(st.integers(1, D // unit))
        return {
            "mode": mode, "layout": layout, "dtype": draw(st.sampled_from(dtypes)),
            "B": draw(st.integers(1, 3)), "S": draw(st.integers(1, 6)),
            "Nq": draw(st.integers(1, 4)), "Nk": draw(st.integers(1, 4)), "D": D, "r": r,
            "cos_batch_one": draw(st.booleans()), "seed": draw(st.integers(0, 2**32 - 1)),
        }

    return case()


def inputs_for_case(case):
    kw = {k: case[k] for k in ("layout", "dtype", "B", "S", "Nq", "Nk", "D", "r",
                               "cos_batch_one")}
    return make_inputs(np.random.default_rng(case["seed"]), **kw)


def rng_for(*parts):
    """A NumPy generator seeded from the test's parameters (stable across runs)."""
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def start_multidevice(which):
    """Starts multidevice/sharded_checks.py WHICH on 8 simulated CPU devices (a subprocess:
    XLA_FLAGS must be set before jax is imported); finish_multidevice waits for it."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.Popen([sys.executable, os.path.join(here, "multidevice", "sharded_checks.py"),
                             which], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish_multidevice(proc, which, timeout=300):
    """Waits for a start_multidevice process and asserts it printed "ok WHICH"."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{which}: no result after {timeout} s\n" + stdout[-3000:]
                             + stderr[-6000:]) from None
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    assert f"ok {which}" in stdout


def run_multidevice(which, timeout=300):
    """Runs multidevice/sharded_checks.py WHICH to the end (start_multidevice, then
    finish_multidevice)."""
    finish_multidevice(start_multidevice(which), which, timeout)
