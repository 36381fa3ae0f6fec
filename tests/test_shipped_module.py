"""The installed extension module holds product code only: the NPU handlers'
host twins (tests/npu_sim/host_handlers.cc) are built by the tests' own CMake
target and never enter the wheel."""

import pathlib

import pytest

try:
    from jax_rope import _jax_rope_ffi
except ImportError as error:
    pytest.skip(f"compiled extension not importable ({error})", allow_module_level=True)

TEST_ONLY = (b"JaxRopeNpuHost", b"npu_host_registrations")


def test_no_test_only_handler_in_the_module_file():
    binary = pathlib.Path(_jax_rope_ffi.__file__).read_bytes()
    found = [name for name in TEST_ONLY if name in binary]
    assert not found, f"{_jax_rope_ffi.__file__} contains {found}"


def test_module_api():
    assert not hasattr(_jax_rope_ffi, "npu_host_registrations")
    public = {name for name in dir(_jax_rope_ffi) if not name.startswith("_")}
    assert public == {"registrations", "npu_registrations", "npu_runtime", "codes",
                      "built_against_jaxlib", "compiler"}, public
    assert all(name.startswith("jax_rope_npu_") for name in _jax_rope_ffi.npu_registrations())
