"""The tests' native artefacts, built by CMake (option JAX_ROPE_BUILD_TESTS) in
build/tests with the kernel library exactly as it ships: the simulated CANN
runtime (its core and one operator library per CANN generation), the NPU
handlers' host twins (tests/npu_sim), and the CPU attention and RoPE handlers with
a limit on their kernels' scratch (tests/native).

`make kernel-test` (and so `make test`) configures and builds that directory;
`build_dir()` reuses it, bringing it up to date with an incremental
`cmake --build`, and configures it the same way when pytest runs without make.
With JAX_ROPE_TESTS_NATIVE_DIR set, `build_dir()` returns that directory as it
is instead: another build of the same targets (`make sanitize-test`'s, built with
AddressSanitizer and UBSan).
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD_DIR = ROOT / "build" / "tests"
SIMULATOR = "libjax_rope_npu_sim.so"  # the simulated libascendcl + libnnopbase
SIMULATOR_OPS = "libjax_rope_npu_sim_ops_{}.so"  # the operators of one CANN generation
SIMULATOR_OPAPI_BASE = "libjax_rope_npu_sim_opapi_base.so"  # a split install's libopapi.so
GENERATIONS = (80, 85, 90)
HOST_HANDLERS = "libjax_rope_npu_host_handlers.so"
SCRATCH_LIMIT_HANDLERS = "libjax_rope_scratch_limit_handlers.so"  # tests/native


class Unavailable(RuntimeError):
    """No CMake or C++ compiler here: the native artefacts cannot be built."""


def _run(command: list[str]) -> None:
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")


def build_dir() -> pathlib.Path:
    """build/tests with every test-only target built (JAX_ROPE_TESTS_NATIVE_DIR instead, as it
    is, where set); raises Unavailable without a toolchain. One process at a time configures
    and builds (a lock file beside build/tests): two test files of one pytest-xdist run ask
    for it."""
    given = os.environ.get("JAX_ROPE_TESTS_NATIVE_DIR")
    if given:
        return _with_artefacts(pathlib.Path(given).resolve())
    cmake = shutil.which("cmake")
    if cmake is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        raise Unavailable("cmake and a C++ compiler are needed for the native test artefacts")
    BUILD_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR.parent / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (BUILD_DIR / "CMakeCache.txt").exists():
            # The same options as the Makefile's native-tests target.
            _run([cmake, "-S", str(ROOT), "-B", str(BUILD_DIR),
                  f"-DPython_EXECUTABLE={sys.executable}", "-DJAX_ROPE_BUILD_TESTS=ON",
                  "-DJAX_ROPE_BUILD_MODULE=OFF"])
        _run([cmake, "--build", str(BUILD_DIR), "--parallel", str(os.cpu_count() or 2)])
    return _with_artefacts(BUILD_DIR)


def _with_artefacts(directory: pathlib.Path) -> pathlib.Path:
    for name in (SIMULATOR, SIMULATOR_OPAPI_BASE, HOST_HANDLERS, SCRATCH_LIMIT_HANDLERS,
                 *(SIMULATOR_OPS.format(g) for g in GENERATIONS)):
        if not (directory / name).exists():
            raise RuntimeError(f"{directory / name} was not built")
    return directory
