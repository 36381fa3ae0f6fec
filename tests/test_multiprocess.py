"""Multi-process: examples/multiprocess_step.py launches two local processes
(jax.distributed on localhost, CPU collectives through gloo) that run one sharded
RoPE + flash-attention training step (batch over processes, heads over local devices)
and a context-parallel attention gradient (tokens over processes); their checksum
equals the one-process run of the same program."""

import json
import os
import subprocess
import sys

import pytest

from conftest import require_backend

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "multiprocess_step.py")


def run_example(*args, timeout=90):
    proc = subprocess.run([sys.executable, EXAMPLE, "--timeout", str(timeout - 10), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("checksum ")]
    assert len(lines) == 1, proc.stdout
    return proc.stdout, json.loads(lines[0][len("checksum "):])


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
def test_two_processes_agree_with_one(backend):
    require_backend(backend)
    out, two = run_example("--processes", "2", "--backend", backend)
    assert "process 0 of 2: 2 of 4 devices" in out and "process 1 of 2: 2 of 4 devices" in out
    _, one = run_example("--processes", "2", "--single", "--backend", backend)
    assert set(two) == set(one) and "loss" in one
    for name in one:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-5), name


def test_launcher_stops_its_workers_on_timeout():
    proc = subprocess.run([sys.executable, EXAMPLE, "--timeout", "0.5"], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 1 and "multi-process step timed out" in proc.stderr
    assert "process 0: exit -9" in proc.stderr and "process 1: exit -9" in proc.stderr
