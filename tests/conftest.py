"""Shared test configuration: hypothesis profiles, the backend fixture and sys.path for the
NumPy oracles (``rope_oracle.py``, ``attention_oracle.py``, ``rope_tables_oracle.py``) and
helpers (``helpers.py``) in this folder.

jax_rope is imported lazily so that ``test_rope_oracle.py`` runs without the package.
Environment: ``HYPOTHESIS_PROFILE=thorough`` for more examples; ``JAX_ROPE_TESTS_SKIP_FFI=1``
skips (instead of failing) the ffi-backend tests where the compiled extension is not built.

The session compiles into a JAX compilation cache of its own (a fresh directory, removed at
exit, inherited by the subprocesses the tests start): a program already compiled by an earlier
test or subprocess of the same run is loaded instead of compiled again (the simulated-CANN
checks, 13 subprocesses compiling much the same programs, took half their time; the whole
suite on 2 cores 16m54s instead of 19m12s). Every program is still compiled once per run.
``JAX_ROPE_TESTS_COMPILATION_CACHE=0`` turns it off; a ``JAX_COMPILATION_CACHE_DIR`` of the
caller's is left alone. ``make test`` runs the files in two pytest-xdist workers, each with a
subdirectory of the cache to itself.

The session (and what it starts) also compiles with ``JAX_DISABLE_MOST_OPTIMIZATIONS=1``:
XLA's CPU backend skips LLVM's optimisation of the code it emits (its HLO passes still run;
IEEE semantics, NaN included, are the same at every LLVM level). The suite is mostly compiling
tiny programs: on 2 Zen 3 cores 13.1 minutes instead of 19.8, every test the same. Our
kernels are compiled C++ and do not change. ``test_masked_positions.py`` compiles as users do
(the default), and a ``JAX_DISABLE_MOST_OPTIMIZATIONS`` of the caller's (``=0``: the whole suite
as users compile) is left alone.
"""

import atexit
import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _session_compilation_cache():
    """Points JAX (read when jax is first imported, here and in subprocesses) at a fresh
    cache directory that takes every program, however quick to compile. Under pytest-xdist
    each worker (and what it starts) gets a subdirectory of the one the controller made: JAX
    writes an entry in place, and a worker must not read another's half-written entry."""
    if os.environ.get("JAX_ROPE_TESTS_COMPILATION_CACHE") == "0" or "jax" in sys.modules:
        return
    session = os.environ.get("JAX_ROPE_TESTS_SESSION_CACHE")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if session is not None and worker is not None:
        if os.environ.get("JAX_COMPILATION_CACHE_DIR") == session:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(session, worker)
        return
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="jax_rope_tests_compilation_cache_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path,
                      JAX_ROPE_TESTS_SESSION_CACHE=path,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


_session_compilation_cache()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

_SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
             HealthCheck.data_too_large]
settings.register_profile("default", deadline=None, max_examples=25,
                          suppress_health_check=_SUPPRESS, print_blob=True, database=None)
settings.register_profile("quick", deadline=None, max_examples=5,
                          suppress_health_check=_SUPPRESS, print_blob=True, database=None)
settings.register_profile("thorough", deadline=None, max_examples=200,
                          suppress_health_check=_SUPPRESS, print_blob=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

BACKENDS = ("ffi", "fallback")

_ffi_probe = {}


def ffi_unavailable_reason():
    """None when the ffi backend runs a tiny RoPE and attention call, else the error
    text (probed once)."""
    if "reason" not in _ffi_probe:
        import jax.numpy as jnp

        import jax_rope as jr
        try:
            with jr.backend("ffi"):
                x = jnp.ones((1, 1, 1, 2), jnp.float32)
                q, _ = jr.apply_rotary_pos_emb(x, x, x, x)
                out, _, _ = jr.flash_attention_score(q, q, q)
                out.block_until_ready()
            _ffi_probe["reason"] = None
        except Exception as e:  # noqa: BLE001 - reported verbatim below
            _ffi_probe["reason"] = f"{type(e).__name__}: {e}"
    return _ffi_probe["reason"]


def require_backend(name):
    if name == "ffi":
        reason = ffi_unavailable_reason()
        if reason is not None:
            msg = f"ffi backend unavailable: {reason}"
            if os.environ.get("JAX_ROPE_TESTS_SKIP_FFI") == "1":
                pytest.skip(msg)
            pytest.fail(msg)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test with jax_rope's backend set to "ffi" or "fallback"."""
    import jax_rope as jr
    require_backend(request.param)
    with jr.backend(request.param):
        yield request.param

