"""Sharded RoPE and attention on 8 simulated CPU devices, in a subprocess (XLA_FLAGS must be
set before jax is imported): equal to the unsharded result, no gathering collectives."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_multidevice(which, timeout=300):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "multidevice", "sharded_checks.py"),
                           which], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"ok {which}" in proc.stdout


def test_sharded_rope_and_attention_on_8_devices():
    run_multidevice("sharding")
