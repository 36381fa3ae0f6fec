"""Layout table: each layout name maps to axis roles, so the rest of the code
sees one canonical description instead of chains of `if layout == ...`.

The codes and roles come from `codes.py` (the mirror of the C++ header the
kernels, handlers and NPU glue read), so Python and C++ cannot disagree.
"""

from __future__ import annotations

import dataclasses

from jax_rope.core.codes import LAYOUT_ROLES, Layout


@dataclasses.dataclass(frozen=True)
class AxisRoles:
    """Axis roles of a kernel layout: query/key/value (and RoPE's cos/sin,
    whose head axis has size 1)."""

    name: str
    code: int  # codes.Layout
    rank: int
    batch: int | None  # None: no batch axis (packed TND)
    seq: int
    head: int

    @property
    def fold_axis(self) -> int:
        """The axis a vmapped axis folds into: batch, or the token axis of TND."""
        return self.seq if self.batch is None else self.batch

    def describe_shape(self) -> str:
        roles = ["D"] * self.rank
        roles[self.seq] = "T" if self.batch is None else "S"
        roles[self.head] = "N"
        if self.batch is not None:
            roles[self.batch] = "B"
        return "(" + ", ".join(roles) + ")"


def _roles(layout: Layout) -> AxisRoles:
    rank, batch, seq, head = LAYOUT_ROLES[layout]
    return AxisRoles(layout.name, int(layout), rank, None if batch < 0 else batch, seq, head)


#: Kernel layouts by name.
KERNEL_LAYOUTS = {layout.name: _roles(layout) for layout in Layout}

#: RoPE's layout names; BSH is a legacy name for the same 4-D layout as BSND (rope.md).
ROPE_LAYOUTS = {**KERNEL_LAYOUTS, "BSH": KERNEL_LAYOUTS["BSND"]}


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """An attention input layout: BSH/SBH are split into heads before the
    kernels see them (`packed_heads`: last axis N*D, head_num required)."""

    name: str
    kernel: str  # the kernel layout after the head split
    rank: int
    packed_heads: bool

    @property
    def roles(self) -> AxisRoles:
        return KERNEL_LAYOUTS[self.kernel]


ATTENTION_LAYOUTS = {
    "BSND": AttentionLayout("BSND", "BSND", 4, False),
    "BNSD": AttentionLayout("BNSD", "BNSD", 4, False),
    "BSH": AttentionLayout("BSH", "BSND", 3, True),
    "SBH": AttentionLayout("SBH", "SBND", 3, True),
    "TND": AttentionLayout("TND", "TND", 3, False),
}
