"""Context-parallel attention on 4 and 8 simulated CPU devices (subprocess), against
single-device flash_attention_score in value and gradient."""

import pytest

from helpers import run_multidevice


@pytest.mark.parametrize("devices", ["4", "8"])
def test_context_parallel_matches_flash_attention(devices):
    run_multidevice(devices)
