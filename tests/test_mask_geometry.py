"""The mask geometry the kernels use: the per-sequence band table, its O(1)
tile classes, and the README's mask pictures."""

import pathlib

import numpy as np
import pytest

from jax_rope import mask_pictures, masks
from jax_rope.attention_options import attention_call

import jax.numpy as jnp

CASES = [
    dict(sparse_mode=0),
    dict(sparse_mode=2),
    dict(sparse_mode=3),
    dict(sparse_mode=4, pre_tokens=5, next_tokens=-2),
    dict(sparse_mode=4, pre_tokens=-3, next_tokens=9),
    dict(sparse_mode=6, prefix="valid"),
]


def table_for(kwargs, q_len, kv_len, batch=2):
    if kwargs.get("prefix") == "valid":  # within [max(Skv - Sq, 0), Skv]
        kwargs = dict(kwargs, prefix=[max(kv_len - q_len, 0) + 1, kv_len - 1])
    query = jnp.zeros((batch, q_len, 1, 4))
    key = jnp.zeros((batch, kv_len, 1, 4))
    options, sizes, _, mask, prefix = attention_call(
        query, key, key, input_layout="BSND", head_num=None, scale=None,
        sparse_mode=kwargs["sparse_mode"], pre_tokens=kwargs.get("pre_tokens", 2**31 - 1),
        next_tokens=kwargs.get("next_tokens", 2**31 - 1), atten_mask=None,
        prefix=kwargs.get("prefix"), actual_seq_qlen=None, actual_seq_kvlen=None,
        backend="fallback")
    return masks.sequence_table(options, sizes.batch, q_len, kv_len, prefix=prefix)


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("q_len, kv_len", [(13, 13), (9, 17), (17, 9)])
def test_tile_classes_agree_with_dense_mask(kwargs, q_len, kv_len):
    table = np.asarray(table_for(kwargs, q_len, kv_len))
    masked = np.asarray(~masks.padded_visibility(jnp.asarray(table), q_len, kv_len))[:, 0]
    block = 4
    classes = masks.tile_classes(table, q_len, kv_len, block, block)
    for b in range(table.shape[0]):
        for qb in range(classes.shape[1]):
            for kb in range(classes.shape[2]):
                tile = masked[b, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
                expected = 0 if tile.all() else (2 if not tile.any() else 1)
                assert classes[b, qb, kb] == expected, (b, qb, kb, tile)


def test_causal_skips_about_half_the_tiles():
    table = np.asarray(table_for(dict(sparse_mode=2), 256, 256, batch=1))
    classes = masks.tile_classes(table, 256, 256, 16, 16)
    visited = np.count_nonzero(classes) / classes.size
    assert 0.5 < visited < 0.56  # 16 of 16 diagonal tiles partial, the rest half empty


def test_readme_pictures_are_the_generated_ones():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert mask_pictures.render() in readme
