"""The integer codes shared by Python, the CPU kernels, the FFI handlers and the
NPU glue: layouts (with their axis roles), rotary modes and sparse modes.

Their one definition is the C++ header `device_kernels/common/codes.h`; this
module is its pure-Python mirror (so the package imports without the compiled
extension). The extension exports the header's tables, `core/extension.py`
refuses to load an extension whose tables differ, and `tests/test_codes.py`
checks this file against both the header text and the extension.
"""

from __future__ import annotations

import enum


class Layout(enum.IntEnum):
    """Kernel layout codes (the NPU operators' inputLayout order)."""

    BSND = 1
    SBND = 2
    BNSD = 3
    TND = 4


class RotaryMode(enum.IntEnum):
    """RoPE rotary modes (spec/rope.md)."""

    HALF = 0
    QUARTER = 1
    INTERLEAVE = 2


class SparseMode(enum.IntEnum):
    """FlashAttentionScore sparse modes (spec/attention.md)."""

    DEFAULT_MASK = 0
    ALL_MASK = 1
    LEFT_UP_CAUSAL = 2
    RIGHT_DOWN_CAUSAL = 3
    BAND = 4
    PREFIX = 5
    PREFIX_COMPRESS = 6
    RIGHT_DOWN_CAUSAL_BAND = 7
    BAND_LEFT_UP_CAUSAL = 8


#: Axis roles per layout: (rank, batch axis or -1 when absent, sequence axis, head axis).
LAYOUT_ROLES = {
    Layout.BSND: (4, 0, 1, 2),
    Layout.SBND: (4, 1, 0, 2),
    Layout.BNSD: (4, 0, 2, 1),
    Layout.TND: (3, -1, 0, 1),
}


def tables() -> dict:
    """Every code as plain data, in the form the extension's `codes()` returns."""
    return {
        "layout": {m.name: int(m) for m in Layout},
        "rotary_mode": {m.name: int(m) for m in RotaryMode},
        "sparse_mode": {m.name: int(m) for m in SparseMode},
        "layout_roles": {int(k): v for k, v in LAYOUT_ROLES.items()},
    }
