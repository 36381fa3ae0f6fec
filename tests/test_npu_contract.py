"""Contract tests of the NPU launch glue against a simulated CANN runtime.

The simulated runtime (tests/npu_sim/sim.cc, attention.cc) and the NPU
handlers' host twins (tests/npu_sim/host_handlers.cc) are CMake's test-only
targets in build/tests (tests/native_build.py). The simulator is laid out as a
temporary CANN-like tree (lib64/libascendcl.so, libnnopbase.so, libopapi.so:
one library), and tests/npu_sim/contract_checks.py runs in a subprocess with
ASCEND_HOME_PATH pointing at it and the host twins' library to register, once
as an Atlas A2 (RoPE forward kernel, FlashAttentionScore and its gradient) and
once as an Ascend 950 (RoPE forward and backward kernels, attention on the
fallback). The simulator checks every call against the documented operator
contract and computes with the CPU kernels. Each check runs on the profiles it
applies to, and where a profile lacks a kernel a check says that the call
lowers to the fallback: nothing is skipped.
"""

import os
import subprocess
import sys

import pytest

import native_build
from jax_rope.core import extension as _extension

HERE = os.path.dirname(os.path.abspath(__file__))
SOCS = {"A2": "Ascend910B2", "950": "Ascend910_9599"}
COMMON = ["forward_bsnd_half", "forward_bsnd_partial_interleave_bf16", "forward_tnd_quarter",
          "forward_float16_matches_fallback", "wrong_call_through_handler_is_an_ffi_error",
          "wrong_call_directly_is_rejected", "describe_reports_simulated_runtime",
          "attention_wrong_calls_directly_are_rejected"]
ATTENTION = ["attention_mode0_no_mask", "attention_mode0_mask_and_band",
             "attention_mode2_bnsd_value_dim", "attention_mode3_sbh", "attention_mode4_band",
             "attention_tnd_varlen_mode3", "attention_tnd_varlen_mode8_split",
             "attention_tnd_causal_with_sq_above_skv_is_rejected"]
CHECKS = {
    "A2": COMMON + ["backward_a2_lowers_to_fallback"] + ATTENTION,
    "950": COMMON + ["backward_950_with_tables", "attention_950_lowers_to_fallback"],
}
CASES = [(profile, name) for profile in sorted(CHECKS) for name in CHECKS[profile]]

pytestmark = pytest.mark.skipif(not _extension.STATUS.loaded,
                                reason="compiled extension not loaded")


@pytest.fixture(scope="module")
def native():
    try:
        return native_build.build_dir()
    except native_build.Unavailable as why:
        pytest.skip(str(why))


@pytest.fixture(scope="module")
def sim_home(tmp_path_factory, native):
    home = tmp_path_factory.mktemp("cann_sim")
    lib = home / "lib64"
    lib.mkdir()
    for name in ("libascendcl.so", "libnnopbase.so", "libopapi.so"):
        (lib / name).symlink_to(native / native_build.SIMULATOR)
    return home


@pytest.fixture(scope="module")
def results(sim_home, native):
    out = {}
    for profile, soc in SOCS.items():
        env = dict(os.environ, ASCEND_HOME_PATH=str(sim_home), JAX_ROPE_SIM_SOC=soc,
                   JAX_PLATFORMS="cpu",
                   JAX_ROPE_NPU_HOST_HANDLERS=str(native / native_build.HOST_HANDLERS))
        env.pop("JAX_ROPE_NPU_PROFILE", None)
        run = subprocess.run([sys.executable, os.path.join(HERE, "npu_sim", "contract_checks.py"),
                              *CHECKS[profile]],
                             env=env, capture_output=True, text=True, timeout=300)
        lines = {line.split(" ", 2)[1].rstrip(":"): line for line in run.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("ok", "FAIL")}
        out[profile] = (lines, run.stderr[-3000:])
    return out


@pytest.mark.parametrize("profile, name", CASES)
def test_contract(results, profile, name):
    lines, stderr = results[profile]
    assert name in lines, f"check did not run; stderr: {stderr}"
    assert lines[name].startswith("ok"), lines[name].replace(" | ", "\n")


def test_every_check_runs_somewhere():
    # The check modules need the simulated runtime to import: read their names.
    names = set()
    for file in ("contract_checks.py", "attention_checks.py"):
        text = open(os.path.join(HERE, "npu_sim", file)).read()
        names |= {line.split("def ", 1)[1].split("(", 1)[0]
                  for line, prev in zip(text.splitlines()[1:], text.splitlines())
                  if prev.strip() == "@check"}
    assert names == {name for _, name in CASES}, names ^ {name for _, name in CASES}


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
