"""RotaryEmbedding: cos/sin tables of `jr.rope_cos_sin` as a Flax NNX layer."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jax_rope.rope.tables import rope_cos_sin


def _freeze(value):
    """A hashable copy of a rope_scaling dict (lists -> tuples), so the layer's graph stays
    static: nnx would otherwise treat a dict of lists as state."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(frozen):
    if frozen is None:
        return None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in frozen}


class RotaryEmbedding(nnx.Module):
    """Rotary position tables: positions in, `(cos, sin)` out, for `apply_rotary_pos_emb`.

    Holds no parameters; its arguments are those of `jr.rope_cos_sin` (scaling in the
    vocabulary of Hugging Face `rope_scaling`). `RotaryEmbedding.from_config(config)` takes a
    whole Hugging Face config (a `config.json` dict or a transformers config object).

    Raises at construction (ValueError/TypeError naming the argument) what rope_cos_sin would
    raise for these arguments.
    """

    def __init__(self, rotary_dim: int, *, base: float = 10000.0, rotary_mode: str = "half",
                 scaling: Mapping | None = None, max_position_embeddings: int | None = None,
                 dtype=jnp.float32):
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"RotaryEmbedding: scaling must be a dict (a Hugging Face "
                            f"rope_scaling) or None, got {type(scaling).__name__}")
        self.rotary_dim = rotary_dim
        self.base = base
        self.rotary_mode = rotary_mode
        self.scaling = _freeze(scaling)
        self.max_position_embeddings = max_position_embeddings
        self.dtype = jnp.dtype(dtype) if dtype is not None else dtype
        # Trace once on a dummy position: every argument error surfaces here, not at first use.
        jax.eval_shape(self, jax.ShapeDtypeStruct((1,), jnp.int32))

    @classmethod
    def from_config(cls, config, *, dtype=None) -> "RotaryEmbedding":
        """From a Hugging Face config as it is (dict or object), through `jr.rope_config`;
        `dtype` overrides the table dtype."""
        from jax_rope.rope.config import rope_config

        kwargs = dict(rope_config(config))
        if dtype is not None:
            kwargs["dtype"] = dtype
        return cls(kwargs.pop("rotary_dim"), **kwargs)

    def __call__(self, positions):
        """`(cos, sin)`, each `positions.shape + (rotary_dim,)`, for integer positions of
        any shape (traced or not)."""
        return rope_cos_sin(positions, self.rotary_dim, base=self.base,
                            rotary_mode=self.rotary_mode, scaling=_thaw(self.scaling),
                            max_position_embeddings=self.max_position_embeddings,
                            dtype=self.dtype)
