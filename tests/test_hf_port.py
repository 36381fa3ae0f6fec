"""The Hugging Face checkpoint port (examples/hf_llama.py) against transformers itself.

For each family (Llama with llama3 RoPE and tied embeddings, Qwen2 with q/k/v biases and
yarn, Phi-3 with fused projections, partial rotary and longrope) a tiny random model is built
with transformers, saved with save_pretrained (safetensors), loaded into the Flax layers and
compared in float32: the logits of a prompt, and a greedy generation through the key/value
cache that crosses the scaled RoPE's original length (so Phi-3 switches to its long factors),
token for token and logit for logit. "Relative" is the largest difference over the largest
reference logit. Needs the optional extras 'flax' and 'hf'.
"""

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("flax.nnx", reason="the optional extra 'flax'")
torch = pytest.importorskip("torch", reason="the optional extra 'hf'")
pytest.importorskip("transformers", reason="the optional extra 'hf'")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the optional extra 'hf'")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import hf_llama  # noqa: E402
import tiny_hf_checkpoints  # noqa: E402

RELATIVE = 1e-5
PROMPT_LEN, NEW_TOKENS = 12, 8      # 20 tokens: past the tiny models' original length of 16


def relative(actual, expected):
    return float(np.abs(np.asarray(actual) - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module", params=tiny_hf_checkpoints.FAMILIES)
def ported(request, tmp_path_factory):
    """(family, transformers model, the ported CausalLM, checkpoint path)."""
    path, reference = tiny_hf_checkpoints.make_tiny_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), seed=0)
    return request.param, reference, hf_llama.load_checkpoint(path), path


def test_checkpoint_is_what_transformers_writes(ported):
    family, _, model, path = ported
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family and list(path.glob("*.safetensors"))
    names = safetensors_numpy.load_file(next(path.glob("*.safetensors"))).keys()
    if family == "phi3":
        assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
        assert model.layers[0].self_attn.rotary.rotary_dim == model.config.head_dim // 2
    if family == "qwen2":
        assert model.layers[0].self_attn.q_proj.bias is not None
    assert (model.lm_head is None) == (family == "llama")        # llama: tied embeddings


def test_prompt_logits_match_transformers(ported):
    _, reference, model, _ = ported
    prompt = np.random.default_rng(0).integers(0, 128, size=(2, PROMPT_LEN))
    with torch.no_grad():
        expected = reference(torch.tensor(prompt)).logits.numpy()
    assert relative(model(prompt), expected) <= RELATIVE


def test_greedy_generation_with_the_cache_matches_transformers(ported):
    _, reference, model, _ = ported
    prompt = np.random.default_rng(1).integers(0, 128, size=(2, PROMPT_LEN))
    tokens, logits = hf_llama.generate(model, prompt, NEW_TOKENS)
    ids = torch.tensor(prompt)
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(tokens, out.sequences.numpy())
    assert relative(logits, torch.stack(out.logits, dim=1).numpy()) <= RELATIVE


def test_a_checkpoint_that_does_not_fit_is_named(tmp_path):
    path, _ = tiny_hf_checkpoints.make_tiny_checkpoint("qwen2", tmp_path / "ok")
    tensors = safetensors_numpy.load_file(path / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    safetensors_numpy.save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \[\('layers', 1, 'self_attn', 'k_proj'"):
        hf_llama.load_checkpoint(broken)
