# Quickstart: `make demo` and `make test` each set everything up from nothing:
# a local virtual environment, the pinned build requirements, the editable
# install with the test and notebook extras (which compiles the C++ extension),
# then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jax_rope-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard xla_ffi/*.cc xla_ffi/*.h device_kernels/cpu/*.cc device_kernels/cpu/*.h device_kernels/npu/*.cc device_kernels/npu/*.h)

KERNEL_TEST := build/attention_kernel_test
KERNEL_SOURCES := device_kernels/cpu/attention_kernels.cc device_kernels/cpu/attention_tiles.cc

.PHONY: demo test kernel-test bench info clean

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The build requirements (jax pinned to the release the FFI headers come from)
	# are read from pyproject.toml, the one place they are written.
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')" > $(VENV)/build-requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/build-requirements.txt
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_rope demo

# The kernels alone, without JAX: a C++ test against a double-precision reference.
$(KERNEL_TEST): $(wildcard device_kernels/cpu/*.cc device_kernels/cpu/*.h device_kernels/cpu/tests/*.cc device_kernels/cpu/tests/*.h)
	mkdir -p build
	$(CXX) -std=c++17 -O2 -fno-math-errno -fno-trapping-math -I. \
		device_kernels/cpu/tests/attention_kernel_test.cc $(KERNEL_SOURCES) -lpthread -o $@

kernel-test: $(KERNEL_TEST)
	$(KERNEL_TEST)

test: $(STAMP) kernel-test
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_rope.py
	$(PY) benchmarks/bench_attention.py

info: $(STAMP)
	$(PY) -m jax_rope info

clean:
	rm -rf $(VENV) build
