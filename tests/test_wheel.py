"""The manylinux wheel (`make wheel`, issue 15) installs and runs with no compiler on PATH.

The test brings the wheel up to date with `make wheel` (a no-op when `make test` has just built
it), creates a fresh virtual environment (no system site-packages, not the development venv),
installs the wheel there with pip, binary wheels only (its dependencies jax, jaxlib and numpy
come from the package index, or pip's cache), with PATH holding nothing but that venv's bin
directory, and then, from a directory outside the checkout so the source tree cannot be
imported: `python -m jax_rope info` must report the compiled extension loaded from the
installed wheel, and a jitted RoPE + fused attention step on backend "ffi" must lower to the
kernels' custom calls and agree with the jax.numpy fallback.
"""

import glob
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++")

STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_rope as jr

    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (2, 16, 4, 64), jnp.float32)
    k = jax.random.normal(jax.random.fold_in(key, 1), (2, 16, 2, 64), jnp.float32)
    v = jax.random.normal(jax.random.fold_in(key, 2), (2, 16, 2, 64), jnp.float32)

    def step(q, k, v):
        cos, sin = jr.rope_cos_sin(jnp.arange(16), 64)
        q, k = jr.apply_rotary_pos_emb(q, k, cos[None, :, None], sin[None, :, None])
        return jr.dot_product_attention(q, k, v, is_causal=True)

    def loss(q, k, v):
        return jnp.sum(step(q, k, v) ** 2)

    results = {}
    for name in ("ffi", "fallback"):
        with jr.backend(name):
            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            hlo = f.lower(q, k, v).as_text()
            calls = [t for t in jr.FFI_TARGETS if t in hlo]
            results[name] = (f(q, k, v), calls)
    assert {"jax_rope_rope_fwd", "jax_rope_attention_fwd", "jax_rope_attention_bwd",
            "jax_rope_rope_bwd"} <= set(results["ffi"][1]), results["ffi"][1]
    assert results["fallback"][1] == [], results["fallback"][1]
    for a, b in zip(jax.tree.leaves(results["ffi"][0]), jax.tree.leaves(results["fallback"][0])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    print("STEP OK", jr.__file__)
""")


def _clean_env(venv):
    """The environment without compilers or the development venv: PATH is the venv's bin only."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_ROPE_", "PYTHON", "CMAKE", "CONDA"))
           and k not in ("VIRTUAL_ENV", "CC", "CXX", "CPATH", "LIBRARY_PATH", "LD_PRELOAD")}
    env["PATH"] = os.path.join(venv, "bin")
    return env


def _run(args, env, cwd, timeout=600):
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel():
    """The repaired manylinux wheel in dist/, rebuilt by make when the sources changed."""
    if shutil.which("make") is None:
        pytest.fail("make is needed to build the wheel (make wheel)")
    _run(["make", "--no-print-directory", "wheel"], dict(os.environ), ROOT, timeout=1200)
    wheels = glob.glob(os.path.join(ROOT, "dist", "jax_rope-*-manylinux_*.whl"))
    assert len(wheels) == 1, f"expected one manylinux wheel in dist/, found {wheels}"
    return wheels[0]


def test_wheel_holds_the_extension_only_and_states_the_jax_range(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    shared = [n for n in names if ".so" in os.path.basename(n)]
    # auditwheel vendors nothing (only glibc/libstdc++/libgcc are linked), and the test-only
    # libraries (simulated CANN, NPU host twins) never ship.
    assert len(shared) == 1 and shared[0].startswith("jax_rope/_jax_rope_ffi."), shared
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.replace(" ", "") in ("Requires-Dist:jax<0.11,>=0.10.2",
                                      "Requires-Dist:jax>=0.10.2,<0.11") for r in requires), requires


def test_wheel_installs_and_runs_without_a_compiler(wheel, tmp_path):
    venv = str(tmp_path / "venv")
    _run([sys.executable, "-m", "venv", venv], dict(os.environ), str(tmp_path))
    env = _clean_env(venv)
    assert [t for t in COMPILERS if shutil.which(t, path=env["PATH"])] == []
    python = os.path.join(venv, "bin", "python")
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "--only-binary=:all:", wheel], env, str(tmp_path))
    _run([python, "-c", "import shutil, sys; missing = [t for t in sys.argv[1:] if "
          "shutil.which(t)]; assert not missing, missing", *COMPILERS], env, str(tmp_path))

    info = _run([python, "-m", "jax_rope", "info"], env, str(tmp_path))
    site = os.path.realpath(venv)
    loaded = [line for line in info.splitlines() if line.strip().startswith("extension:")]
    assert loaded and "loaded (" in loaded[0], info
    assert os.path.realpath(loaded[0].split("loaded (", 1)[1].rstrip(")")).startswith(site), info

    out = _run([python, "-c", STEP], env, str(tmp_path))
    assert "STEP OK" in out, out
    assert os.path.realpath(out.split("STEP OK", 1)[1].strip()).startswith(site), out
