# Quickstart: `make demo` and `make test` each set everything up from nothing:
# a local virtual environment, the pinned build requirements, the editable
# install with test extras (which compiles the C++ extension), then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jax_rope-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard xla_ffi/*.cc xla_ffi/*.h device_kernels/cpu/*.cc device_kernels/cpu/*.h)

.PHONY: demo test bench info clean

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The build requirements (jax pinned to the release the FFI headers come from)
	# are read from pyproject.toml, the one place they are written.
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')" > $(VENV)/build-requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/build-requirements.txt
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_rope demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_rope.py

info: $(STAMP)
	$(PY) -m jax_rope info

clean:
	rm -rf $(VENV) build
