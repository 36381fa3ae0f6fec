"""Context-parallel attention on 4 and 8 simulated CPU devices (subprocess), against
single-device flash_attention_score in value and gradient."""

import pytest

from helpers import finish_multidevice, start_multidevice

DEVICES = ("4", "8")


@pytest.fixture(scope="module")
def checks():
    """Both device counts' subprocesses, started together: most of their time is compiling,
    one core each (on 2 cores 87 s one after the other)."""
    procs = {devices: start_multidevice(devices) for devices in DEVICES}
    yield procs
    for proc in procs.values():  # a test that did not wait for its process
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("devices", DEVICES)
def test_context_parallel_matches_flash_attention(devices, checks):
    finish_multidevice(checks[devices], devices)
