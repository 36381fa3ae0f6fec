"""Contract tests of the NPU launch glue against a simulated CANN runtime.

tests/npu_sim/sim.cc is compiled here with g++ into a temporary CANN-like tree
(lib64/libascendcl.so, libnnopbase.so, libopapi.so: one library), and
tests/npu_sim/contract_checks.py runs in a subprocess with ASCEND_HOME_PATH
pointing at it, once as an Atlas A2 (forward kernel) and once as an Ascend 950
(forward and backward kernels). The simulator checks every call against the
documented operator contract and computes with the CPU kernels.
"""

import os
import shutil
import subprocess
import sys

import pytest

from jax_rope import _extension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SOCS = {"A2": "Ascend910B2", "950": "Ascend910_9599"}
CHECKS = ["forward_bsnd_half", "forward_bsnd_partial_interleave_bf16", "forward_tnd_quarter",
          "forward_float16_matches_fallback", "backward_950_with_tables",
          "wrong_call_through_handler_is_an_ffi_error", "wrong_call_directly_is_rejected",
          "describe_reports_simulated_runtime"]

pytestmark = [
    pytest.mark.skipif(not _extension.STATUS.loaded, reason="compiled extension not loaded"),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler"),
]


@pytest.fixture(scope="module")
def sim_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("cann_sim")
    lib = home / "lib64"
    lib.mkdir()
    target = lib / "libjax_rope_npu_sim.so"
    subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-shared", "-fPIC",
                    "-ffp-contract=off", f"-I{ROOT}", os.path.join(HERE, "npu_sim", "sim.cc"),
                    os.path.join(ROOT, "device_kernels", "cpu", "rope_kernels.cc"),
                    os.path.join(ROOT, "device_kernels", "cpu", "rope_geometry.cc"),
                    "-o", str(target)], check=True)
    for name in ("libascendcl.so", "libnnopbase.so", "libopapi.so"):
        (lib / name).symlink_to(target.name)
    return home


@pytest.fixture(scope="module")
def results(sim_home):
    out = {}
    for profile, soc in SOCS.items():
        env = dict(os.environ, ASCEND_HOME_PATH=str(sim_home), JAX_ROPE_SIM_SOC=soc,
                   JAX_PLATFORMS="cpu")
        env.pop("JAX_ROPE_NPU_PROFILE", None)
        run = subprocess.run([sys.executable, os.path.join(HERE, "npu_sim", "contract_checks.py")],
                             env=env, capture_output=True, text=True, timeout=300)
        lines = {line.split(" ", 2)[1].rstrip(":"): line for line in run.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("ok", "skip", "FAIL")}
        out[profile] = (lines, run.stderr[-3000:])
    return out


@pytest.mark.parametrize("profile", sorted(SOCS))
@pytest.mark.parametrize("name", CHECKS)
def test_contract(results, profile, name):
    lines, stderr = results[profile]
    assert name in lines, f"check did not run; stderr: {stderr}"
    line = lines[name]
    if line.startswith("skip"):
        pytest.skip(f"{name} needs another chip profile than {profile}")
    assert line.startswith("ok"), line.replace(" | ", "\n")


def test_without_cann_the_runtime_is_absent_and_says_why():
    code = ("import jax_rope as jr, jax.numpy as jnp\n"
            "info = jr.describe(as_dict=True)\n"
            "print(info['NPU runtime'])\n"
            "q = jnp.ones((1, 2, 2, 4)); c = jnp.ones((1, 2, 1, 4))\n"
            "print('sum', float(jr.apply_rotary_pos_emb(q, q, c, c)[0].sum()))\n")
    env = dict(os.environ, ASCEND_HOME_PATH="/nonexistent", ASCEND_TOOLKIT_HOME="",
               LD_LIBRARY_PATH="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("absent (CANN not found: libascendcl.so not found"), out
    assert "sum 16.0" in out
