"""CANN generations: which of jax_rope's operators a CANN install has and what
its RoPE tiling accepts, as data, and the version of an install.

With a CANN runtime loaded, the operators come from the libraries themselves
(per-operator dlsym) and the version from the install's
`ascend_toolkit_install.info`; without one (exporting for an NPU from a host
without it) both come from the generation named by JAX_ROPE_CANN_VERSION
(default DEFAULT_CANN).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

ROPE_V2, ROPE_GRAD = "aclnnApplyRotaryPosEmbV2", "aclnnApplyRotaryPosEmbGrad"
#: The single-tensor RoPE backward (Atlas A2/A3 and 950), one call per tensor.
ROPE_SINGLE_GRAD = "aclnnRotaryPositionEmbeddingGrad"
FA, FA_VARLEN = "aclnnFlashAttentionScore", "aclnnFlashAttentionVarLenScore"
FA_GRAD, FA_VARLEN_GRAD = "aclnnFlashAttentionScoreGrad", "aclnnFlashAttentionUnpaddingScoreGrad"
# The V2 forms: pseType (0-3) and qStartIdx/kvStartIdx (ALiBi offsets).
FA_V2, FA_VARLEN_V2 = "aclnnFlashAttentionScoreV2", "aclnnFlashAttentionVarLenScoreV2"
FA_GRAD_V2 = "aclnnFlashAttentionScoreGradV2"
FA_VARLEN_GRAD_V2 = "aclnnFlashAttentionUnpaddingScoreGradV2"
OPERATORS = (ROPE_V2, ROPE_GRAD, ROPE_SINGLE_GRAD, FA, FA_VARLEN, FA_GRAD, FA_VARLEN_GRAD,
             FA_V2, FA_VARLEN_V2, FA_GRAD_V2, FA_VARLEN_GRAD_V2)
#: (backward, varlen, V2) -> the attention operator.
FLASH_OPERATORS = {(False, False, False): FA, (False, True, False): FA_VARLEN,
                   (True, False, False): FA_GRAD, (True, True, False): FA_VARLEN_GRAD,
                   (False, False, True): FA_V2, (False, True, True): FA_VARLEN_V2,
                   (True, False, True): FA_GRAD_V2, (True, True, True): FA_VARLEN_GRAD_V2}
# The V2 forms are taken to ship with every generation here (torch_npu's
# npu_fusion_attention_v2 calls them unguarded); which release first had them
# is not established.
_FLASH = (FA, FA_VARLEN, FA_GRAD, FA_VARLEN_GRAD, FA_V2, FA_VARLEN_V2, FA_GRAD_V2,
          FA_VARLEN_GRAD_V2)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one CANN generation ships (the simulator in tests/npu_sim has each)."""

    version: str
    install: str
    operators: tuple[str, ...]
    partial_rotary: bool  # the RoPE tiling accepts cos D < query D
    # The VarLen attention tiling takes a sequence with query tokens and no key
    # (CANN 8.0's, of 2024, refuses it: "seqLen is not 0 and sekvLen is 0").
    keyless_sequences: bool


# aclnnRotaryPositionEmbeddingGrad: the first ACLNN docs that list it for
# Atlas A2/A3 are CANN 8.3.RC1's (4-D tensors only; 3-D TND came later), and
# torch_npu calls it only behind DO_COMPATIBILITY: so 8.0 is taken not to have it.
GENERATIONS = {
    "8.0": Generation("8.0", "monolithic libopapi.so", _FLASH, False, False),
    "8.5": Generation("8.5", "split: libopapi_transformer.so",
                      _FLASH + (ROPE_V2, ROPE_SINGLE_GRAD), False, True),
    "9.0": Generation("9.0", "split: libopapi_transformer.so",
                      _FLASH + (ROPE_V2, ROPE_GRAD, ROPE_SINGLE_GRAD), True, True),
}
DEFAULT_CANN = "8.5"


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a CANN version string such as 8.0.RC1 or 8.5.0."""
    m = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def generation_for(version: tuple[int, int]) -> Generation:
    """The newest generation not newer than `version` (the oldest one below all)."""
    known = sorted(GENERATIONS.values(), key=lambda g: parse_version(g.version))
    chosen = known[0]
    for g in known:
        if parse_version(g.version) <= version:
            chosen = g
    return chosen


def installed_version(acl_library: str) -> tuple[str, str] | None:
    """(version, file) from the ascend_toolkit_install.info of the install whose
    lib64 holds `acl_library`, or None when there is none."""
    if not acl_library:
        return None
    root = os.path.dirname(os.path.dirname(acl_library))
    for info in sorted(glob.glob(os.path.join(root, "*", "ascend_toolkit_install.info"))
                       + glob.glob(os.path.join(root, "ascend_toolkit_install.info"))):
        with open(info, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("version=") and parse_version(line[8:]):
                    return line[8:].strip(), info
    return None


def configured() -> tuple[Generation, str]:
    """The generation named by JAX_ROPE_CANN_VERSION, else the default, and whence."""
    text = os.environ.get("JAX_ROPE_CANN_VERSION")
    if text is None:
        return GENERATIONS[DEFAULT_CANN], "default"
    version = parse_version(text)
    if version is None:
        raise ValueError(f"JAX_ROPE_CANN_VERSION must be a CANN version such as 8.0 or 8.5.0, "
                         f"got {text!r}")
    return generation_for(version), f"JAX_ROPE_CANN_VERSION={text}"
