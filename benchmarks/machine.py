"""The machine's own limits, measured in the benchmark's run: the float32 FMA peak of a
register-only AVX-512/AVX2 loop, the same for the bfloat16 dot instruction where the CPU has
it, and a copy's GB/s, all on every core (benchmarks/machine_limits.cc).

The program is compiled at benchmark time with the project's C++ compiler: the one CMake
recorded for the extension build (build/*/CMakeCache.txt), else $CXX, else c++; flags
-O3 -std=c++17 -pthread (the instruction sets are chosen per function at run time, as in
the kernels). The binary lands in build/benchmarks/.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SOURCE = os.path.join(HERE, "machine_limits.cc")
FLAGS = ["-O3", "-std=c++17", "-pthread"]


def project_compiler() -> str | None:
    """The C++ compiler of the project's CMake build, else $CXX, else c++ (None if none)."""
    for cache in sorted(glob.glob(os.path.join(REPO, "build", "*", "CMakeCache.txt"))):
        with open(cache) as f:
            match = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", f.read(), re.MULTILINE)
        if match and os.path.exists(match.group(1).strip()):
            return match.group(1).strip()
    return shutil.which(os.environ.get("CXX", "c++"))


def build() -> str:
    """Compiles machine_limits.cc (when the source is newer than the binary); returns its path."""
    compiler = project_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX) to build machine_limits.cc")
    binary = os.path.join(REPO, "build", "benchmarks", "machine_limits")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(SOURCE):
        os.makedirs(os.path.dirname(binary), exist_ok=True)
        subprocess.run([compiler, *FLAGS, SOURCE, "-o", binary], check=True)
    return binary


def measure(threads: int | None = None, copy_mib: int = 256) -> dict:
    """{"isa", "threads", "fma_gflops", "bf16_gflops" (0 without AVX512_BF16),
    "amx_bf16_gflops" (0 without AMX-BF16), "copy_gbps", "copy_mib"}: best of a few runs each.

    copy_gbps counts bytes read plus bytes written, per second.
    """
    command = [build(), str(threads or os.cpu_count() or 1), str(copy_mib)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    limits = json.loads(done.stdout.strip().splitlines()[-1])
    limits.pop("check", None)
    return limits


if __name__ == "__main__":
    print(json.dumps(measure()))
