"""Tiny random Hugging Face checkpoints (no network): the stand-ins for real ones in the port
test, the port notebook and `port_hf_checkpoint.py --tiny`.

Each family is built with `transformers` (the optional `hf` extra: torch CPU build), given
random weights from `torch.manual_seed(seed)` (biases and norm weights too, so every tensor
matters), and saved with `save_pretrained` (config.json + model.safetensors). The RoPE of each
is a scaled one, with lengths small enough that a short generation crosses them:

- llama: llama3 scaling (original length 16), tied input/output embeddings;
- qwen2: q/k/v biases, yarn scaling (factor 4, original length 16);
- phi3: fused qkv_proj and gate_up_proj, partial rotary (0.5), longrope with
  `original_max_position_embeddings` (16) at the top level, as Phi-3.5 keeps it.
"""

from __future__ import annotations

import pathlib

FAMILIES = ("llama", "qwen2", "phi3")
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_config(family: str):
    """The transformers config of a tiny model of `family` (one of FAMILIES)."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(
            **_COMMON, tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "qwen2":
        return transformers.Qwen2Config(
            **_COMMON, tie_word_embeddings=False, rope_theta=1000000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 16})
    if family == "phi3":
        head_dim = _COMMON["hidden_size"] // _COMMON["num_attention_heads"]
        half = int(head_dim * 0.5) // 2                       # factors per rotary frequency
        return transformers.Phi3Config(
            **_COMMON, tie_word_embeddings=False, partial_rotary_factor=0.5,
            original_max_position_embeddings=16,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(half)],
                          "long_factor": [2.0 + 1.5 * i for i in range(half)]})
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def make_tiny_model(family: str, seed: int = 0):
    """A randomly initialised transformers model (float32, eager attention, eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    return model.eval()


def make_tiny_checkpoint(family: str, path, seed: int = 0):
    """Saves a tiny random `family` model to `path` (created); returns (path, the model)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(family, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path, model
