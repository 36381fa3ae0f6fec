"""A Llama-family decoder in Flax NNX on `jax_rope.nn`, loaded from a Hugging Face checkpoint.

    model = load_checkpoint("path/to/checkpoint")          # config.json + *.safetensors
    tokens, logits = generate(model, prompt_ids, new_tokens=8)

The model is token embedding -> N x (RMSNorm, grouped-query attention with fused RoPE,
RMSNorm, SwiGLU MLP) -> RMSNorm -> lm head (its own weight, or the embedding's when
`tie_word_embeddings`). Supported `model_type`s: llama, mistral, qwen2 (q/k/v biases) and
phi3 (fused `qkv_proj` and `gate_up_proj`, partial rotary, longrope); the RoPE comes from the
whole config through `RotaryEmbedding.from_config` (`jr.rope_config`). The weights are read
with the `safetensors` library (numpy), so neither torch nor transformers is needed here.
Used by `examples/port_hf_checkpoint.py`, `notebooks/05_hf_port.ipynb` and
`tests/test_hf_port.py`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_rope as jr
from jax_rope.nn import GroupedQueryAttention, RotaryEmbedding

MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the model needs from a Hugging Face `config.json`."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    out_bias: bool
    # longrope's switch from short to long factors (Phi-3): the cached keys must be recomputed
    longrope_switch: int | None = None

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """Reads a config.json dict; ValueError for what this small model does not support."""
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config['model_type'] must be one of {MODEL_TYPES}, "
                             f"got {model_type!r}")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config['hidden_act'] must be 'silu' (SwiGLU), got {act!r}")
        for key in ("mlp_bias", "sliding_window", "use_sliding_window"):
            if config.get(key):
                raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported by this "
                                 f"example (sliding windows would map to sparse_mode 4)")
        heads = config["num_attention_heads"]
        scaling = jr.rope_config(config)["scaling"]
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type, vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama's attention_bias covers o_proj as well.
            qkv_bias=model_type == "qwen2" or attention_bias,
            out_bias=model_type != "qwen2" and attention_bias,
            longrope_switch=scaling["original_max_position_embeddings"]
            if scaling and scaling["rope_type"] == "longrope" else None)


class RMSNorm(nnx.Module):
    """Hugging Face's RMSNorm: weight * x / sqrt(mean(x^2) + eps), in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, c: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(c.hidden_size, c.intermediate_size)
        self.up_proj = linear(c.hidden_size, c.intermediate_size)
        self.down_proj = linear(c.intermediate_size, c.hidden_size)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, *, param_dtype, rngs):
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = GroupedQueryAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary=rotary,
            sparse_mode=2, qkv_bias=c.qkv_bias, out_bias=c.out_bias, param_dtype=param_dtype,
            rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.mlp = SwiGLU(c, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, decode: bool):
        x = x + self.self_attn(self.input_layernorm(x), decode=decode)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nnx.Module):
    """Token ids (B, S) -> next-token logits (B, S, vocab)."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, *, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.config = c
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, param_dtype=param_dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, rotary, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = None if c.tie_word_embeddings else nnx.Linear(
            c.hidden_size, c.vocab_size, use_bias=False, param_dtype=param_dtype, rngs=rngs)

    def init_cache(self, batch: int, max_length: int) -> None:
        """An empty key/value cache in every layer (for `decode=True` calls)."""
        for layer in self.layers:
            layer.self_attn.init_cache(batch, max_length)

    def __call__(self, tokens, decode: bool = False):
        """decode=True appends the tokens to the cache and sees everything cached before."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, decode)
        x = self.norm(x)
        return self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)


# ---------------------------------------------------------------------------------------------
# Loading a checkpoint
# ---------------------------------------------------------------------------------------------

def _hf_to_nnx(name: str, array: np.ndarray, c: ModelConfig) -> dict:
    """One Hugging Face tensor -> {nnx state path: array} (Linear weights are transposed:
    torch keeps (out, in), nnx.Linear's kernel is (in, out)); Phi-3's fused tensors are split."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts == ["embed_tokens", "weight"]:
        return {("embed_tokens", "embedding"): array}
    if parts == ["norm", "weight"]:
        return {("norm", "weight"): array}
    if parts == ["lm_head", "weight"]:
        return {} if c.tie_word_embeddings else {("lm_head", "kernel"): array.T}
    if parts[0] != "layers" or len(parts) < 4:
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
    prefix = ("layers", int(parts[1]))
    module, leaf = tuple(parts[2:-1]), parts[-1]
    if len(module) == 1 and leaf == "weight":                        # the two RMSNorms
        return {prefix + module + ("weight",): array}
    if module == ("self_attn", "qkv_proj"):                          # Phi-3: [q; k; v] rows
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        pieces = np.split(array, [q, q + kv], axis=0)
        return {k: v for name_, piece in zip(("q_proj", "k_proj", "v_proj"), pieces)
                for k, v in _hf_to_nnx(f"layers.{parts[1]}.self_attn.{name_}.{leaf}", piece,
                                       c).items()}
    if module == ("mlp", "gate_up_proj"):                            # Phi-3: [gate; up] rows
        gate, up = np.split(array, 2, axis=0)
        return {**_hf_to_nnx(f"layers.{parts[1]}.mlp.gate_proj.{leaf}", gate, c),
                **_hf_to_nnx(f"layers.{parts[1]}.mlp.up_proj.{leaf}", up, c)}
    if leaf == "weight":
        return {prefix + module + ("kernel",): array.T}
    if leaf == "bias":
        return {prefix + module + ("bias",): array}
    raise ValueError(f"unexpected tensor {name!r} in the checkpoint")


def read_checkpoint(path) -> tuple[dict, dict]:
    """(config.json as a dict, {tensor name: numpy array}) of a checkpoint directory."""
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path}")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return config, tensors


def load_checkpoint(path, *, param_dtype=jnp.float32) -> CausalLM:
    """A `CausalLM` with the weights of a Hugging Face checkpoint directory.

    The model is built abstractly (no random initialisation), then every parameter is taken
    from the checkpoint; a missing or unexpected tensor is a ValueError naming it.
    """
    config, tensors = read_checkpoint(path)
    c = ModelConfig.from_hf(config)
    rotary = RotaryEmbedding.from_config(config)
    abstract = nnx.eval_shape(lambda: CausalLM(c, rotary, param_dtype=param_dtype,
                                               rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    loaded = {}
    for name, array in tensors.items():
        loaded.update(_hf_to_nnx(name, array, c))
    flat = dict(nnx.to_flat_state(state))
    missing = sorted(set(flat) - set(loaded))
    unexpected = sorted(set(loaded) - set(flat))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    for key, variable in flat.items():
        value = loaded[key]
        if value.shape != variable.shape:
            raise ValueError(f"tensor for {key} has shape {value.shape}, the model expects "
                             f"{variable.shape}")
        variable.set_value(jnp.asarray(value, param_dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------------
# Greedy generation with the key/value cache
# ---------------------------------------------------------------------------------------------

@nnx.jit
def _last_logits(model: CausalLM, tokens):
    return model(tokens, decode=True)[:, -1]


def generate(model: CausalLM, prompt, new_tokens: int):
    """Greedy continuation of int `prompt` (B, S): returns (tokens (B, S + new_tokens), the
    logits that chose each new token (B, new_tokens, vocab)). The prompt fills the cache in
    one call; then each step feeds one token (one compiled program per shape).

    longrope (Phi-3) rotates with its short factors up to `original_max_position_embeddings`
    tokens and with the long ones beyond; as transformers does, the first step past that length
    recomputes the whole context, so no cached key keeps a short-factor rotation.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    capacity = prompt.shape[1] + new_tokens
    switch = model.config.longrope_switch
    model.init_cache(prompt.shape[0], capacity)
    tokens, logits = prompt, []
    step = prompt
    for _ in range(new_tokens):
        cached = tokens.shape[1] - step.shape[1]
        if switch is not None and 0 < cached <= switch < tokens.shape[1]:
            model.init_cache(prompt.shape[0], capacity)
            step = tokens
        logits.append(_last_logits(model, step))
        step = jnp.argmax(logits[-1], axis=-1).astype(jnp.int32)[:, None]
        tokens = jnp.concatenate([tokens, step], axis=1)
    return tokens, jnp.stack(logits, axis=1)
