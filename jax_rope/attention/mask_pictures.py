"""Text pictures of every sparse_mode, drawn from `sparse_mask` itself.

`python -m jax_rope masks` prints the block the README shows ('x' = masked,
'.' = visible); a test checks the README still matches it.
"""

from __future__ import annotations

import numpy as np

from jax_rope.attention.masks import sparse_mask

Q_LEN, KV_LEN = 6, 8
_PREFIX_MASK = np.triu(np.ones((Q_LEN, KV_LEN), bool), KV_LEN - Q_LEN + 1)
_PREFIX_MASK[:, :4] = False
_USER_MASK = np.zeros((Q_LEN, KV_LEN), bool)
_USER_MASK[:, 1::3] = True

# (title, sparse_mask keyword arguments); q_len/kv_len are added for the padded ones.
EXAMPLES = [
    ("0 defaultMask, atten_mask + band pre=2 next=1",
     dict(sparse_mode=0, atten_mask=_USER_MASK, pre_tokens=2, next_tokens=1)),
    ("1 allMask (atten_mask as given)", dict(sparse_mode=1, atten_mask=_USER_MASK)),
    ("2 leftUpCausal", dict(sparse_mode=2)),
    ("3 rightDownCausal", dict(sparse_mode=3)),
    ("4 band pre=3 next=0 (bottom-right)", dict(sparse_mode=4, pre_tokens=3, next_tokens=0)),
    ("5 prefix=[4], full mask", dict(sparse_mode=5, prefix=[4], atten_mask=_PREFIX_MASK)),
    ("6 prefix=[4], compressed", dict(sparse_mode=6, prefix=[4])),
    ("7 varlen q=[3,5] kv=[3,9] pre=6 next=-2",
     dict(sparse_mode=7, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9], pre_tokens=6,
          next_tokens=-2)),
    ("8 varlen q=[3,8] kv=[4,9] pre=4 next=1",
     dict(sparse_mode=8, actual_seq_qlen=[3, 8], actual_seq_kvlen=[4, 9], pre_tokens=4,
          next_tokens=1)),
]


def picture(kwargs) -> list[str]:
    varlen = "actual_seq_qlen" in kwargs
    size = (None, None) if varlen else (Q_LEN, KV_LEN)
    mask = np.asarray(sparse_mask(q_len=size[0], kv_len=size[1], **kwargs))
    mask = mask if varlen else mask.reshape(mask.shape[-2:])
    return [" ".join("x" if m else "." for m in row) for row in mask]


def render(columns: int = 3) -> str:
    """All examples as one text block, `columns` pictures side by side."""
    blocks = [[title] + picture(kwargs) for title, kwargs in EXAMPLES]
    width = max(len(line) for block in blocks for line in block) + 3
    lines = []
    for start in range(0, len(blocks), columns):
        row = blocks[start:start + columns]
        height = max(len(b) for b in row)
        for i in range(height):
            lines.append("".join((b[i] if i < len(b) else "").ljust(width) for b in row).rstrip())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
