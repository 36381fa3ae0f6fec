"""jr.rope_config (spec/api.md, issue 15): a Hugging Face config as it is -> rope_cos_sin's
keywords, checked against transformers' own rotary embedding classes (the `hf` test extra).

The configs below are the RoPE-relevant fields of the published `config.json` files (the
other fields do not reach RoPE). transformers computes its tables in float32 from float32
inverse frequencies, so its own angles carry an error of a few eps32 * |angle| (about 1e-2 at
position 160k); rope_cos_sin's phases are exact. Tables are therefore compared element by
element within 1e-6 + 4 * eps32 * |angle| (times the attention factor), inverse frequencies
at 1e-6 relative and attention factors at 1e-7 relative.
"""

import copy
import importlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_rope as jr
from jax_rope.rope.tables import frequency_plan

torch = pytest.importorskip("torch")  # installed by `make test` (extra "hf"): never skipped there
transformers = pytest.importorskip("transformers")

EPS32 = float(np.finfo(np.float32).eps)

# Phi-3.5-mini-instruct (longrope, full rotary, original length at the top level).
PHI35_SHORT = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705,
               1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
               1.0499999523162842, 1.0699999332427979, 1.0999999046325684, 1.1099998950958252,
               1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
               1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
               1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
               1.9899996519088745, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
               2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0299997329711914,
               2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
               2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
               2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713,
               2.5899994373321533, 2.729999542236328, 2.749999523162842, 2.8399994373321533]
PHI35_LONG = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
              1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661,
              3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
              7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945,
              24.46000099182129, 28.57000160217041, 30.420001983642578, 30.840002059936523,
              32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
              50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305,
              58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203,
              62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
              63.93000411987305, 63.96000289916992, 63.97000503540039, 64.02999877929688,
              64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
              64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062]
# Phi-4-mini-instruct (longrope, partial_rotary_factor 0.75: 96 of 128 dims, 48 factors).
PHI4_FACTORS = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897,
                1.956131817, 2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075,
                3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555,
                7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
                14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418,
                28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]

CONFIGS = {
    "llama3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # Qwen2.5-7B-Instruct with the YaRN block its model card adds for long context.
    "qwen2.5-7b-yarn": {
        "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                         "type": "yarn"}},
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"}},
    "phi3.5-mini": {
        "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"long_factor": PHI35_LONG, "short_factor": PHI35_SHORT,
                         "type": "longrope"}},
    "phi4-mini": {
        "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24,
        "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0,
        "rope_scaling": {"long_factor": PHI4_FACTORS, "short_factor": PHI4_FACTORS,
                         "type": "longrope"}},
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False}},
    "gpt-neox-20b": {
        "model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64,
        "max_position_embeddings": 2048, "rotary_emb_base": 10000, "rotary_pct": 0.25},
    # LongChat-13B-16k / Vicuna-13B-v1.5-16k style linear interpolation.
    "llama2-linear": {
        "model_type": "llama", "hidden_size": 5120, "num_attention_heads": 40,
        "max_position_embeddings": 16384, "rope_theta": 10000.0,
        "rope_scaling": {"factor": 4.0, "type": "linear"}},
    "llama2-dynamic": {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
        "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"factor": 2.0, "type": "dynamic"}},
}

_RNG = np.random.default_rng(15)
# Short (<= 4095: inside every pre-training length) and long (up to 160k) position sets.
SHORT = np.concatenate([np.arange(64), _RNG.integers(64, 4095, 60), [4095]])
LONG = np.concatenate([np.arange(32), _RNG.integers(32, 160_000, 94), [160_000]])


def hf_rotary(cfg):
    """(transformers config object, the model family's rotary embedding module)."""
    config = transformers.AutoConfig.for_model(**copy.deepcopy(cfg))
    module = importlib.import_module(f"transformers.models.{cfg['model_type']}."
                                     f"modeling_{cfg['model_type']}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    return config, cls(config)


def hf_tables(rotary, positions):
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(x, torch.as_tensor(positions, dtype=torch.int64)[None])
    return cos[0].numpy(), sin[0].numpy(), rotary.inv_freq.numpy().copy(), rotary.attention_scaling


@pytest.mark.parametrize("positions", [SHORT, LONG], ids=["short", "long160k"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(name, positions):
    cfg = CONFIGS[name]
    kwargs = jr.rope_config(cfg)
    hf_config, rotary = hf_rotary(cfg)
    assert jr.rope_config(hf_config) == kwargs  # the object gives the same as its config.json
    hf_cos, hf_sin, hf_inv, hf_att = hf_tables(rotary, positions)

    plan = frequency_plan(positions, kwargs["rotary_dim"], kwargs["base"], kwargs["scaling"],
                          kwargs["max_position_embeddings"])
    np.testing.assert_allclose(np.asarray(plan.inv_freq), hf_inv, rtol=1e-6)
    np.testing.assert_allclose(plan.attention, hf_att, rtol=1e-7)

    cos, sin = jr.rope_cos_sin(jnp.asarray(positions), **kwargs)
    assert cos.dtype == jnp.float32 and cos.shape == (len(positions), kwargs["rotary_dim"])
    if kwargs["rotary_mode"] == "interleave":  # transformers lays DeepSeek's tables as halves
        hf_cos, hf_sin = (np.repeat(t[:, : t.shape[1] // 2], 2, axis=1) for t in (hf_cos, hf_sin))
    elif hf_cos.shape[1] == kwargs["rotary_dim"] // 2:  # gpt-oss keeps f, rotating halves
        hf_cos, hf_sin = (np.concatenate([t, t], axis=1) for t in (hf_cos, hf_sin))
    angle = np.abs(positions[:, None].astype(np.float64) * np.asarray(plan.inv_freq, np.float64))
    angle = np.concatenate([angle, angle], axis=1) if kwargs["rotary_mode"] == "half" \
        else np.repeat(angle, 2, axis=1)
    bound = hf_att * (1e-6 + 4 * EPS32 * angle)
    assert np.all(np.abs(np.asarray(cos) - hf_cos) <= bound)
    assert np.all(np.abs(np.asarray(sin) - hf_sin) <= bound)


def test_phi3_original_length_at_top_level_gives_attention_factor_1_19():
    kwargs = jr.rope_config(CONFIGS["phi3.5-mini"])
    assert kwargs["scaling"]["original_max_position_embeddings"] == 4096
    assert kwargs["rotary_dim"] == 96 and kwargs["max_position_embeddings"] == 131072
    plan = frequency_plan(LONG, 96, kwargs["base"], kwargs["scaling"], 131072)
    expected = np.sqrt(1 + np.log(131072 / 4096) / np.log(4096))
    assert plan.attention == pytest.approx(expected, rel=1e-12)
    assert round(plan.attention, 2) == 1.19
    # Past the 4096 pre-training tokens the long factors apply (not only past 131072).
    cos, _ = jr.rope_cos_sin(jnp.arange(4097), **kwargs)
    cos_long, _ = jr.rope_cos_sin(jnp.arange(4097), 96, base=10000.0, scaling={
        "rope_type": "longrope", "short_factor": PHI35_LONG, "long_factor": PHI35_LONG,
        "original_max_position_embeddings": 4096}, max_position_embeddings=131072)
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(cos_long))


def test_gpt_neox_and_deepseek_fields():
    neox = jr.rope_config(CONFIGS["gpt-neox-20b"])
    assert neox == {"rotary_dim": 24, "base": 10000.0, "rotary_mode": "half", "scaling": None,
                    "max_position_embeddings": 2048}
    # GPTNeoXConfig's default rotary_pct (0.25) when config.json leaves it out.
    cfg = {k: v for k, v in CONFIGS["gpt-neox-20b"].items() if k != "rotary_pct"}
    assert jr.rope_config(cfg)["rotary_dim"] == 24
    deepseek = jr.rope_config(CONFIGS["deepseek-v3"])
    assert deepseek["rotary_dim"] == 64 and deepseek["rotary_mode"] == "interleave"
    assert jr.rope_config({**CONFIGS["deepseek-v3"], "rope_interleave": False})[
        "rotary_mode"] == "half"


def test_deepseek_interleave_gives_transformers_rotation_up_to_its_feature_order():
    """rotary_mode "interleave" on transformers' own tables rotates as its
    apply_rotary_pos_emb_interleave, which leaves the features de-interleaved (evens, odds);
    q and k share that order, so the attention scores are the same. (The tables themselves
    are compared in test_matches_transformers.)"""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave)
    cfg = CONFIGS["deepseek-v3"]
    assert jr.rope_config(cfg)["rotary_mode"] == "interleave"
    _, rotary = hf_rotary(cfg)
    positions = np.arange(0, 6000, 250)
    hf_cos, hf_sin, _, _ = hf_tables(rotary, positions)
    q = _RNG.standard_normal((1, 2, len(positions), 64)).astype(np.float32)  # (B, N, S, D)
    k = _RNG.standard_normal((1, 1, len(positions), 64)).astype(np.float32)
    hq, hk = apply_rotary_pos_emb_interleave(torch.from_numpy(q), torch.from_numpy(k),
                                              torch.from_numpy(hf_cos)[None],
                                              torch.from_numpy(hf_sin)[None])
    cos, sin = (jnp.repeat(jnp.asarray(t[:, :32]), 2, axis=-1)[None, None]
                for t in (hf_cos, hf_sin))
    oq, ok = jr.apply_rotary_pos_emb(jnp.asarray(q), jnp.asarray(k), cos, sin, layout="BNSD",
                                     rotary_mode="interleave")
    for ours, theirs in ((oq, hq), (ok, hk)):
        ours = np.asarray(ours)
        np.testing.assert_allclose(np.concatenate([ours[..., 0::2], ours[..., 1::2]], -1),
                                   theirs.numpy(), rtol=1e-6, atol=1e-6)


def test_rope_parameters_of_transformers_5_and_precedence():
    # transformers 5.x writes rope_theta and rope_type inside rope_parameters.
    new = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
           "max_position_embeddings": 131072,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    assert jr.rope_config(new) == jr.rope_config(CONFIGS["llama3.1-8b"])
    # Inside the dict beats the top level, except original_max_position_embeddings.
    both = {**new, "rope_theta": 1.0, "original_max_position_embeddings": 4096}
    kwargs = jr.rope_config(both)
    assert kwargs["base"] == 500000.0
    assert kwargs["scaling"]["original_max_position_embeddings"] == 4096
    assert "rope_theta" not in kwargs["scaling"]
    assert jr.rope_config({"head_dim": 8})["base"] == 10000.0  # transformers' default theta
    # Works with any attribute object, e.g. a namespace.
    import types
    ns = types.SimpleNamespace(**CONFIGS["qwen2.5-7b-yarn"])
    assert jr.rope_config(ns) == jr.rope_config(CONFIGS["qwen2.5-7b-yarn"])
    jax.jit(lambda p: jr.rope_cos_sin(p, **jr.rope_config(ns)))(jnp.arange(8))


@pytest.mark.parametrize("name", ["qwen2.5-7b-yarn", "phi3.5-mini", "llama3.1-8b"])
def test_missing_original_length_names_the_key(name):
    cfg = copy.deepcopy(CONFIGS[name])
    cfg.pop("original_max_position_embeddings", None)
    cfg["rope_scaling"].pop("original_max_position_embeddings", None)
    with pytest.raises(ValueError, match="'original_max_position_embeddings'"):
        jr.rope_config(cfg)


@pytest.mark.parametrize("config, exc, match", [
    (None, TypeError, "config must be a dict"),
    ("llama", TypeError, "config must be a dict"),
    ({"hidden_size": 64}, ValueError, "'head_dim', or 'hidden_size' and 'num_attention_heads'"),
    ({"head_dim": 64, "rope_scaling": [1]}, TypeError, r"config\['rope_scaling'\] must be a dict"),
    ({"head_dim": 64, "rope_scaling": {"rope_type": "mrope"}}, ValueError, "rope_type must be"),
    ({"head_dim": 10, "partial_rotary_factor": 0.5}, ValueError, r"int\(10 \* 0.5\) must be a po"),
    ({"head_dim": 64, "rope_theta": -1.0}, ValueError, r"config\['rope_theta'\] must be a pos"),
    ({"head_dim": 64, "layer_types": ["full_attention"],
      "rope_parameters": {"full_attention": {"rope_type": "default"}}}, ValueError,
     "one RoPE per layer type"),
])
def test_errors(config, exc, match):
    with pytest.raises(exc, match=match):
        jr.rope_config(config)
