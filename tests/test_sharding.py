"""Sharded RoPE and attention on 8 simulated CPU devices, in a subprocess (XLA_FLAGS must be
set before jax is imported): equal to the unsharded result, no gathering collectives. And
the partitioning wraps each primitive's own lowering rule, touching private JAX only
through the shim."""

import os
import pathlib
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = pathlib.Path(HERE).parent / "jax_rope"


def run_multidevice(which, timeout=300):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "multidevice", "sharded_checks.py"),
                           which], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"ok {which}" in proc.stdout


def test_sharded_rope_and_attention_on_8_devices():
    run_multidevice("sharding")


def test_partitioning_wraps_each_primitives_own_lowering_rule():
    from jax_rope import attention_primitives, rope_primitives, sharding
    rules = {**rope_primitives.LOWERING_RULES, **attention_primitives.LOWERING_RULES}
    assert set(rules) == {rope_primitives.rope_fwd_p, rope_primitives.rope_bwd_p,
                          attention_primitives.attention_scores_p,
                          attention_primitives.attention_fwd_p,
                          attention_primitives.attention_bwd_p}
    assert set(sharding.LOCAL_PRIMITIVES) == set(rules)
    for prim, local in sharding.LOCAL_PRIMITIVES.items():
        assert local.name == prim.name + "_local"


def test_private_jax_only_in_the_shim():
    users = sorted(p.name for p in PACKAGE.glob("*.py") if "jax._src" in p.read_text())
    assert users == ["_jax_shim.py"]
