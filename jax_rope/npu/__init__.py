"""The Ascend NPU: chip profiles as data (`profiles`), CANN generations
(`cann`), what they cover (`coverage`), and the runtime, platform and handler
registration (`runtime`). The NPU lowering itself is part of each primitive's
definition (rope/primitives.py, attention/primitives.py)."""

from jax_rope.npu.profiles import PROFILES, Profile, profile_for_soc
from jax_rope.npu.runtime import (PLATFORM, current_cann, current_profile, describe,
                                  enable_lowering_without_device, kernels_unavailable,
                                  missing_operator, runtime)

ROPE_FWD, ROPE_BWD, ROPE_BWD_NO_INPUTS = (
    "jax_rope_npu_rope_fwd", "jax_rope_npu_rope_bwd", "jax_rope_npu_rope_bwd_no_inputs")
# The RoPE backward through aclnnRotaryPositionEmbeddingGrad (Atlas A2/A3).
ROPE_SINGLE_BWD, ROPE_SINGLE_BWD_NO_INPUTS = (
    "jax_rope_npu_rope_single_bwd", "jax_rope_npu_rope_single_bwd_no_inputs")
ATTENTION_FWD, ATTENTION_BWD = "jax_rope_npu_attention_fwd", "jax_rope_npu_attention_bwd"
#: Custom-call targets of the NPU kernels (for jax.export's disabled_checks).
FFI_TARGETS = (ROPE_FWD, ROPE_BWD, ROPE_BWD_NO_INPUTS, ROPE_SINGLE_BWD,
               ROPE_SINGLE_BWD_NO_INPUTS, ATTENTION_FWD, ATTENTION_BWD)
#: The NPU pads softmax_max / softmax_sum to a trailing axis of this width.
STATS_WIDTH = 8

__all__ = ["ATTENTION_BWD", "ATTENTION_FWD", "FFI_TARGETS", "PLATFORM", "PROFILES", "Profile",
           "ROPE_BWD", "ROPE_BWD_NO_INPUTS", "ROPE_FWD", "ROPE_SINGLE_BWD",
           "ROPE_SINGLE_BWD_NO_INPUTS", "STATS_WIDTH", "current_cann",
           "current_profile", "describe", "enable_lowering_without_device",
           "kernels_unavailable", "missing_operator", "profile_for_soc", "runtime"]
