"""Sharded RoPE and attention on 8 simulated CPU devices, in a subprocess (XLA_FLAGS must be
set before jax is imported): equal to the unsharded result, no gathering collectives. And
each primitive is registered once, with its partitioning on every platform, touching
private JAX only through the shim."""

import os
import pathlib

import pytest

from helpers import run_multidevice

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = pathlib.Path(HERE).parent / "jax_rope"


def test_sharded_rope_and_attention_on_8_devices():
    run_multidevice("sharding")


@pytest.mark.parametrize("platform", ["cpu", "npu"])
def test_sharded_calls_keep_the_kernel_inside_the_partitioned_region(platform):
    run_multidevice(f"partitioned:{platform}")


def test_one_registration_per_primitive():
    """Each primitive is defined once (core.primitive.define_primitive) with its kernels,
    fallback and partitioning; the primitive the operators bind has a single lowering rule
    for every platform (the partitioned wrapper), so no platform bypasses partitioning."""
    from jax.interpreters import mlir

    from jax_rope import npu
    from jax_rope.attention import primitives as attention_primitives
    from jax_rope.core.primitive import DEFINITIONS
    from jax_rope.rope import primitives as rope_primitives
    bound = {rope_primitives.rope_fwd_p, rope_primitives.rope_bwd_p,
             attention_primitives.attention_scores_p, attention_primitives.attention_fwd_p,
             attention_primitives.attention_bwd_p}
    assert {d.primitive for d in DEFINITIONS.values()} == bound
    for name, definition in DEFINITIONS.items():
        assert definition.primitive.name == name
        assert definition.local.name == name + "_local"
        platforms = {k.platform for k in definition.kernels}
        assert "cpu" in platforms
        assert (npu.PLATFORM in platforms) == (name != "jax_rope_attention_scores")
        for k in definition.kernels:  # the kernels' lowering lives beside the primitive
            assert k.lower.__module__ in ("jax_rope.rope.primitives",
                                          "jax_rope.attention.primitives",
                                          "jax_rope.attention.npu_lowering")
        # the bound primitive has no platform-specific rule: one rule, partitioned, everywhere
        for platform in ("cpu", npu.PLATFORM, "cuda"):
            assert definition.primitive not in mlir._platform_specific_lowerings.get(platform, {})


def test_lowering_rules_registered_in_one_module():
    sources = {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in PACKAGE.rglob("*.py")}
    # the operators' primitives: core/primitive.py; the host-check primitive of the
    # run-time checks defines its own lowering next to it
    assert sorted(n for n, text in sources.items() if "register_lowering" in text) == \
        ["core/primitive.py", "core/runtime_checks.py"]


def test_private_jax_only_in_the_shim():
    users = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                   if "jax._src" in p.read_text())
    assert users == ["core/_jax_shim.py"]
