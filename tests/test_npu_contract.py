"""Contract tests of the NPU launch glue against a simulated CANN runtime, per
CANN generation and chip.

The simulated runtime (tests/npu_sim: the core sim_core.cc, the operator
libraries sim_ops.cc + attention.cc built once per generation) and the NPU
handlers' host twins (tests/npu_sim/host_handlers.cc) are CMake's test-only
targets in build/tests (tests/native_build.py). Each generation is laid out as
a CANN tree of its own (lib64/libascendcl.so and libnnopbase.so: the core;
8.0: a monolithic libopapi.so; 8.5 and 9.0: an operator-less libopapi.so and
libopapi_transformer.so; the version in ascend_toolkit_install.info), and
tests/npu_sim/contract_checks.py runs in a subprocess per generation x chip
(Atlas A2, A3, 310P, Ascend 950, and an unsupported Ascend910A), with
ASCEND_HOME_PATH pointing at the tree. The simulator checks every call against
the documented operator contract of its generation and chip and computes as
the real operator does; each check says which path (NPU kernel or fallback)
it expects there and compares with the oracle: nothing is skipped.
"""

import concurrent.futures
import os
import subprocess
import sys

import pytest

import native_build
from jax_rope.core import extension as _extension

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATIONS = {80: "8.0.RC1", 85: "8.5.0", 90: "9.0.0"}
CHIPS = {"A2": "Ascend910B2", "A3": "Ascend910_9392", "310P": "Ascend310P3",
         "950": "Ascend910_9599", "unsupported": "Ascend910A"}
EVERYWHERE = ["forward_bsnd_half", "forward_tnd_half",
              "w3_interleave_and_quarter_are_not_sent_to_old_chips", "w4_rope_beyond_the_ub_limit",
              "w11_partial_rotary_only_where_the_cann_accepts_it",
              "forward_float16_matches_fallback", "w10_backward_with_and_without_inputs",
              "w1_operators_resolved_per_library", "describe_reports_simulated_runtime",
              "attention_mode0_no_mask", "w6_mode0_mask_and_band",
              "w7_rows_masked_by_the_user_mask", "w8_prefix_mode_with_a_shared_mask",
              "w5_tnd_statistics_with_several_heads", "w9_host_lists_read_through_pinned_memory",
              "attention_mode2_bnsd_value_dim",
              "attention_mode3_sbh", "attention_mode4_band", "attention_tnd_varlen_mode3",
              "attention_tnd_varlen_mode8_split", "attention_tnd_tokens_after_the_last_sequence",
              "attention_tnd_keyless_sequence",
              "attention_tnd_causal_with_sq_above_skv_takes_the_fallback",
              "attention_invalid_traced_lengths_and_prefix_are_refused"]
# Issue 14 (pse / ALiBi / dropout, bias_dropout_checks.py): slow (jit of each path
# and its fallback), so on one combination, with the kernel (its uncovered cases take
# the fallback there; which calls reach the kernel elsewhere: test_npu_bias_dropout.py).
BIAS_DROPOUT = ["pse_types_0_and_1_full_and_row", "alibi_with_start_offsets",
                "tnd_packed_pse_and_mode8_alibi", "compressed_pse_read_as_the_npu_reads_it",
                "dropout_mask_is_the_keep_function_packed",
                "bias_dropout_outside_the_operator_takes_the_fallback"]
BIAS_DROPOUT_COMBOS = {("A2", 85)}


def checks_for(chip, gen):
    """The checks of one generation x chip: everything, plus what needs a kernel there."""
    names = list(EVERYWHERE)
    if (chip, gen) in BIAS_DROPOUT_COMBOS:
        names += BIAS_DROPOUT
    if chip != "unsupported":
        names.append("wrong_call_through_handler_is_an_ffi_error")
    if chip != "unsupported" and gen >= 85:  # where a RoPE kernel runs (16-bit: the glue's)
        names += ["rope_16_bit_dtypes", "wrong_call_directly_is_rejected",
                  "rope_in_place_rotates_the_donated_buffers",
                  "executor_freed_when_workspace_allocation_fails"]
    if chip in ("A2", "A3"):
        names += ["attention_wrong_calls_directly_are_rejected", "attention_16_bit_dtypes",
                  "attention_handlers_refuse_unknown_attributes", "attention_vmapped_tnd_calls",
                  "bias_dropout_wrong_calls_directly_are_rejected",
                  "a2_backward_uses_rotary_position_embedding_grad"]
    if chip in ("A2", "A3") and gen >= 85:
        names.append("rotary_position_embedding_grad_wrong_calls_are_rejected")
    if chip in ("A2", "A3") or (chip != "unsupported" and gen >= 85):  # a kernel runs
        names.append("runtime_failures_are_ffi_errors")
    if chip == "unsupported":
        names.append("w12_unsupported_soc_takes_the_fallback")
    return names


COMBOS = [(chip, gen) for gen in GENERATIONS for chip in CHIPS
          if chip != "unsupported" or gen == 85]
CASES = [(f"{chip}-cann{gen}", name) for chip, gen in COMBOS for name in checks_for(chip, gen)]

pytestmark = pytest.mark.skipif(not _extension.STATUS.loaded,
                                reason="compiled extension not loaded")


@pytest.fixture(scope="module")
def native():
    try:
        return native_build.build_dir()
    except native_build.Unavailable as why:
        pytest.skip(str(why))


def cann_tree(root, native, gen):
    """A simulated CANN install of generation `gen` under `root`."""
    lib = root / "lib64"
    lib.mkdir(parents=True)
    for name in ("libascendcl.so", "libnnopbase.so"):
        (lib / name).symlink_to(native / native_build.SIMULATOR)
    ops = native / native_build.SIMULATOR_OPS.format(gen)
    if gen == 80:
        (lib / "libopapi.so").symlink_to(ops)
    else:
        (lib / "libopapi.so").symlink_to(native / native_build.SIMULATOR_OPAPI_BASE)
        (lib / "libopapi_transformer.so").symlink_to(ops)
    (root / "x86_64-linux").mkdir()
    (root / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        f"package_name=Ascend-cann-toolkit\nversion={GENERATIONS[gen]}\n")
    return root


@pytest.fixture(scope="module")
def trees(tmp_path_factory, native):
    base = tmp_path_factory.mktemp("cann_sim")
    return {gen: cann_tree(base / f"cann{gen}", native, gen) for gen in GENERATIONS}


def sim_env(tree, native, chip, gen):
    env = dict(os.environ, ASCEND_HOME_PATH=str(tree), JAX_ROPE_SIM_SOC=CHIPS[chip],
               JAX_ROPE_SIM_CHIP=chip, JAX_ROPE_SIM_GEN=str(gen), JAX_PLATFORMS="cpu",
               JAX_ROPE_NPU_HOST_HANDLERS=str(native / native_build.HOST_HANDLERS))
    for name in ("JAX_ROPE_NPU_PROFILE", "JAX_ROPE_CANN_VERSION", "ASCEND_CUSTOM_OPP_PATH",
                 "ASCEND_OPP_PATH"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def results(trees, native):
    def run(combo):
        chip, gen = combo
        run = subprocess.run(
            [sys.executable, os.path.join(HERE, "npu_sim", "contract_checks.py"),
             *checks_for(chip, gen)],
            env=sim_env(trees[gen], native, chip, gen), capture_output=True, text=True,
            timeout=300)
        lines = {line.split(" ", 2)[1].rstrip(":"): line for line in run.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("ok", "FAIL")}
        return f"{chip}-cann{gen}", (lines, run.stderr[-3000:])

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, COMBOS))


@pytest.mark.parametrize("combo, name", CASES)
def test_contract(results, combo, name):
    lines, stderr = results[combo]
    assert name in lines, f"check did not run; stderr: {stderr}"
    assert lines[name].startswith("ok"), lines[name].replace(" | ", "\n")


def test_every_check_runs_somewhere():
    # The check modules need the simulated runtime to import: read their names.
    names = set()
    for file in ("contract_checks.py", "attention_checks.py", "bias_dropout_checks.py",
                 "runtime_failure_checks.py"):
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


def test_relative_ascend_home_path_is_not_used(trees, native):
    # A relative ASCEND_HOME_PATH would load libraries from the working directory.
    code = "import jax_rope as jr\nprint(jr.describe(as_dict=True)['NPU runtime'])\n"
    env = sim_env(trees[85], native, "A2", 85)
    env.update(ASCEND_HOME_PATH="cann85", ASCEND_TOOLKIT_HOME="cann85", LD_LIBRARY_PATH="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=trees[85].parent).stdout
    assert out.startswith("absent (CANN not found"), out


def test_npu_platform_naming_a_jax_platform_is_an_error():
    env = dict(os.environ, JAX_ROPE_NPU_PLATFORM="cpu")
    run = subprocess.run([sys.executable, "-c", "import jax_rope"], env=env, capture_output=True,
                         text=True)
    assert run.returncode != 0
    assert "JAX_ROPE_NPU_PLATFORM must name the Ascend NPU's PJRT platform" in run.stderr, \
        run.stderr[-2000:]


_DESCRIBE = ("import jax_rope as jr, jax.numpy as jnp\n"
             "info = jr.describe(as_dict=True)\n"
             "print('runtime', info['NPU runtime'])\n"
             "for op, where in info['NPU operators'].items(): print('op', op, where)\n")


def describe_in(env):
    out = subprocess.run([sys.executable, "-c", _DESCRIBE], env=env, capture_output=True,
                         text=True, check=True).stdout
    ops = dict(line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("op "))
    return out.splitlines()[0], ops


@pytest.mark.parametrize("value, disabled", [("1", True), ("yes", True), ("0", False),
                                             ("", False)])
def test_disable_npu_variable(trees, native, value, disabled):
    env = dict(sim_env(trees[85], native, "A2", 85), JAX_ROPE_DISABLE_NPU=value)
    runtime, _ = describe_in(env)
    if disabled:
        assert runtime == "runtime absent (disabled by JAX_ROPE_DISABLE_NPU)", runtime
    else:
        assert runtime.startswith("runtime available (libascendcl from "), runtime


def test_custom_operator_builds_come_first(trees, native, tmp_path):
    """$ASCEND_CUSTOM_OPP_PATH entries (absolute ones, in order), then
    $ASCEND_OPP_PATH/vendors/*, then the install's libraries: here a CANN 8.0 tree
    (no ApplyRotaryPosEmbV2) with the 8.5 operators as a custom build."""
    custom = tmp_path / "custom" / "vendor_a" / "op_api" / "lib"
    custom.mkdir(parents=True)
    (custom / "libcust_opapi.so").symlink_to(native / native_build.SIMULATOR_OPS.format(85))
    vendors = tmp_path / "opp" / "vendors" / "vendor_b" / "op_api" / "lib"
    vendors.mkdir(parents=True)
    (vendors / "libcust_opapi.so").symlink_to(native / native_build.SIMULATOR_OPS.format(90))
    env = sim_env(trees[80], native, "A2", 80)
    _, plain = describe_in(env)
    assert plain["aclnnApplyRotaryPosEmbV2"] == "missing", plain
    assert plain["aclnnFlashAttentionScore"].endswith("lib64/libopapi.so"), plain
    env.update(ASCEND_CUSTOM_OPP_PATH=f"relative/dir:{tmp_path / 'custom' / 'vendor_a'}",
               ASCEND_OPP_PATH=str(tmp_path / "opp"))
    _, ops = describe_in(env)
    first, second = str(custom / "libcust_opapi.so"), str(vendors / "libcust_opapi.so")
    assert ops["aclnnApplyRotaryPosEmbV2"] == first, ops
    assert ops["aclnnFlashAttentionScore"] == first, ops
    assert ops["aclnnApplyRotaryPosEmbGrad"] == second, ops  # 9.0 only: the vendors' build
