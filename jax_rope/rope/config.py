"""A Hugging Face model config as it is -> the keyword arguments of `rope_cos_sin`
(spec/api.md: `jr.rope_cos_sin(positions, **jr.rope_config(config))`).

Reads the fields transformers' RoPE code reads (modeling_rope_utils.py, transformers 5.x:
`convert_rope_params_to_dict` and `standardize_rope_params`), from a `config.json` dict or any
object with those attributes, without importing transformers. The precedence is that library's:
a key inside `rope_scaling` / `rope_parameters` beats the same key at the top level, except
`original_max_position_embeddings`, where the top level wins (Phi-3 keeps it there).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Old names transformers still accepts: Phi-3's first configs called longrope "su".
_TYPE_ALIASES = {"su": "longrope"}
# Types whose numbers depend on the pre-training length (guessing it silently changes them).
_NEED_ORIGINAL = ("llama3", "yarn", "longrope")
# Models whose config class supplies a default the config.json may leave out.
_PARTIAL_DEFAULTS = {"gpt_neox": 0.25}        # GPTNeoXConfig: rotary_pct = 0.25
_INTERLEAVE_DEFAULTS = {"deepseek_v3": True}  # DeepseekV3Config: rope_interleave = True


def _reader(config):
    """get(key) -> the value or None, for a mapping or an attribute object."""
    if isinstance(config, Mapping):
        return config.get
    if config is None or isinstance(config, (str, bytes, numbers.Number, list, tuple)):
        raise TypeError("rope_config: config must be a dict (config.json) or an object with "
                        f"its attributes (e.g. a transformers config), got "
                        f"{type(config).__name__}")
    return lambda key: getattr(config, key, None)


def _positive(name, value, kind=numbers.Real):
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 or (
            isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"rope_config: config[{name!r}] must be a positive number, got {value!r}")
    return value


def _rope_parameters(get):
    """A copy of rope_scaling (which wins, as in transformers) or rope_parameters, or {}."""
    for key in ("rope_scaling", "rope_parameters"):
        params = get(key)
        if params:
            break
    else:
        return {}
    if not isinstance(params, Mapping):
        raise TypeError(f"rope_config: config[{key!r}] must be a dict, got "
                        f"{type(params).__name__}")
    layer_types = get("layer_types") or ()
    if any(name in params for name in layer_types) or any(
            isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"rope_config: config[{key!r}] holds one RoPE per layer type "
                         f"({sorted(params)}); pass one of them as a config of its own")
    return dict(params)


def _head_dim(get):
    # DeepSeek's MLA rotates only the qk_rope_head_dim part (its config's head_dim is that).
    for key in ("qk_rope_head_dim", "head_dim"):
        if get(key) is not None:
            return _positive(key, get(key), numbers.Integral)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if hidden is None or heads is None:
        raise ValueError("rope_config: config needs 'head_dim', or 'hidden_size' and "
                         f"'num_attention_heads', got head_dim=None, hidden_size={hidden!r}, "
                         f"num_attention_heads={heads!r}")
    return (_positive("hidden_size", hidden, numbers.Integral)
            // _positive("num_attention_heads", heads, numbers.Integral))


def rope_config(config) -> dict:
    """The keyword arguments of `rope_cos_sin` for a Hugging Face model config, as it is.

    Usage: `cos, sin = jr.rope_cos_sin(positions, **jr.rope_config(config))` (add `dtype=`
    yourself; tables are float32 by default, as transformers computes them).

    Args:
      config: a dict as in `config.json`, or any object with those attributes (e.g. a
        `transformers` config; transformers is not imported). Read: `rope_theta` (GPT-NeoX:
        `rotary_emb_base`), `partial_rotary_factor` (GPT-NeoX: `rotary_pct`), `head_dim`
        (DeepSeek: `qk_rope_head_dim`; else `hidden_size // num_attention_heads`),
        `max_position_embeddings`, a top-level `original_max_position_embeddings` (Phi-3), and
        `rope_scaling` or the newer `rope_parameters` (which may hold `rope_theta`,
        `rope_type` and `partial_rotary_factor` themselves), `rope_interleave` (DeepSeek).

    Returns:
      dict with `rotary_dim` (int(head_dim * partial_rotary_factor)), `base`, `rotary_mode`
      ("half", or "interleave" for DeepSeek's `rope_interleave`, which transformers applies
      as a de-interleave followed by rotate_half: the same attention scores), `scaling` (None
      or the `rope_scaling` dict with its type in "rope_type" and the pre-training length in
      "original_max_position_embeddings") and `max_position_embeddings`.

    Raises:
      TypeError: config is not a dict or an attribute object; rope_scaling not a dict.
      ValueError: a rope type rope_cos_sin does not know (named); per-layer-type RoPE; no head
        dim; an odd rotary dim; a llama3/yarn/longrope config whose
        `original_max_position_embeddings` is nowhere (transformers would silently use
        max_position_embeddings; this names the key instead of guessing).
    """
    get = _reader(config)
    model_type = get("model_type")
    params = _rope_parameters(get)

    base = params.pop("rope_theta", None)
    for key in ("rope_theta", "rotary_emb_base"):
        if base is None:
            base = get(key)
    base = float(_positive("rope_theta", 10000.0 if base is None else base))

    partial = params.pop("partial_rotary_factor", None)
    for key in ("partial_rotary_factor", "rotary_pct"):
        if partial is None:
            partial = get(key)
    if partial is None:
        partial = _PARTIAL_DEFAULTS.get(model_type, 1.0)
    partial = _positive("partial_rotary_factor", partial)
    head_dim = _head_dim(get)
    rotary_dim = int(head_dim * partial)  # transformers' rounding
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_config: the rotary dim int(head_dim * partial_rotary_factor) = "
                         f"int({head_dim} * {partial}) must be a positive even number, "
                         f"got {rotary_dim}")

    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    rope_type = _TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in _TYPES:
        raise ValueError(f"rope_config: rope_type must be one of {_TYPES}, got {rope_type!r}")

    max_pos = get("max_position_embeddings")
    scaling = None
    if rope_type != "default":
        scaling = {"rope_type": rope_type, **params}
        if rope_type in _NEED_ORIGINAL:
            top = get("original_max_position_embeddings")
            original = top if top is not None else params.get("original_max_position_embeddings")
            if original is None:
                raise ValueError(
                    f"rope_config: a {rope_type!r} config needs the pre-training length "
                    "'original_max_position_embeddings' (in rope_scaling/rope_parameters or at "
                    "the top level), found neither")
            scaling["original_max_position_embeddings"] = original

    interleave = get("rope_interleave")
    if interleave is None:
        interleave = _INTERLEAVE_DEFAULTS.get(model_type, False)
    return {"rotary_dim": rotary_dim, "base": base,
            "rotary_mode": "interleave" if interleave else "half", "scaling": scaling,
            "max_position_embeddings": max_pos}
