"""Layout table: each layout name maps to axis roles, so the rest of the code
sees one canonical description instead of chains of `if layout == ...`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeLayout:
    """Axis roles of query/key (and cos/sin, whose head axis is 1)."""

    name: str
    code: int  # shared with the C++ kernels and the NPU operator
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


ROPE_LAYOUTS = {
    "BSND": RopeLayout("BSND", 1, 4, batch=0, seq=1, head=2),
    # BSH is a legacy name for the same 4-D layout (rope.md), not a 3-D one.
    "BSH": RopeLayout("BSND", 1, 4, batch=0, seq=1, head=2),
    "SBND": RopeLayout("SBND", 2, 4, batch=1, seq=0, head=2),
    "BNSD": RopeLayout("BNSD", 3, 4, batch=0, seq=2, head=1),
    "TND": RopeLayout("TND", 4, 3, batch=None, seq=0, head=1),
}


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """Axis roles of an attention layout after BSH/SBH are split into heads.

    `kernel` names the 4-D (or TND) layout the kernels see; `packed_heads` marks
    the 3-D layouts whose last axis is N*D (head_num required).
    """

    name: str
    kernel: str
    rank: int
    packed_heads: bool

    @property
    def roles(self) -> RopeLayout:
        return ROPE_LAYOUTS[self.kernel]


ATTENTION_LAYOUTS = {
    "BSND": AttentionLayout("BSND", "BSND", 4, False),
    "BNSD": AttentionLayout("BNSD", "BNSD", 4, False),
    "BSH": AttentionLayout("BSH", "BSND", 3, True),
    "SBH": AttentionLayout("SBH", "SBND", 3, True),
    "TND": AttentionLayout("TND", "TND", 3, False),
}
