"""jax_rope.nn: the Flax NNX rotary embedding and grouped-query attention layers.

References are independent of the code under test: the float64 NumPy oracles written from the
spec (rope tables, RoPE, masked attention) for the forward, a small jax.numpy dense attention
for the gradients, and transformers' own rotary embedding for a config read as it is.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle
import rope_oracle
import rope_tables_oracle

nnx = pytest.importorskip("flax.nnx", reason="the optional extra 'flax'")
from jax_rope.nn import GroupedQueryAttention, RotaryEmbedding  # noqa: E402
from jax_rope.nn.rotary import _thaw  # noqa: E402

H, N1, N2, D = 32, 4, 2, 16


def make_layer(rotary_dim=8, scaling=None, seed=0, **kw):
    rotary = RotaryEmbedding(rotary_dim, base=10000.0, scaling=scaling,
                             max_position_embeddings=64)
    layer = GroupedQueryAttention(H, N1, N2, D, rotary=rotary, rngs=nnx.Rngs(seed), **kw)
    if kw.get("qkv_bias"):  # nnx initialises biases to 0: make them matter
        for i, proj in enumerate((layer.q_proj, layer.k_proj, layer.v_proj)):
            proj.bias[...] = jax.random.normal(jax.random.key(10 + i), proj.bias.shape)
    return layer


def reference(layer, x, positions, **attention_kw):
    """The layer in float64 from the oracles: projections, RoPE, masked attention, output."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f64(x)
    packed = x.ndim == 2

    def project(proj, heads):
        y = x @ f64(proj.kernel[...]) + (f64(proj.bias[...]) if proj.bias is not None else 0)
        return y.reshape(x.shape[:-1] + (heads, D))
    q, k, v = project(layer.q_proj, N1), project(layer.k_proj, N2), project(layer.v_proj, N2)
    rot = layer.rotary
    cos, sin = rope_tables_oracle.cos_sin(np.asarray(positions), rot.rotary_dim, rot.base,
                                          rot.rotary_mode, _thaw(rot.scaling),
                                          rot.max_position_embeddings)
    expand = (slice(None), None) if packed else (None, slice(None), None)
    if np.asarray(positions).ndim == 2:
        expand = (slice(None), slice(None), None)
    layout = "TND" if packed else "BSND"
    q, k = rope_oracle.apply_rotary_pos_emb(q, k, cos[expand], sin[expand], layout,
                                            rot.rotary_mode)
    out, _, _ = attention_oracle.flash_attention_score(q, k, v, input_layout=layout,
                                                       **attention_kw)
    out = out.reshape(x.shape[:-1] + (N1 * D,)) @ f64(layer.o_proj.kernel[...])
    return out


def assert_close(actual, expected, tol=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected)
    scale = max(np.abs(expected).max(), 1e-30)
    np.testing.assert_allclose(actual / scale, expected / scale, atol=tol, rtol=0)


def test_import_without_flax_names_the_extra():
    code = ("import sys; sys.modules['flax'] = None\n"  # None in sys.modules: ImportError
            "import jax_rope as jr, jax.numpy as jnp\n"
            "jr.rope_cos_sin(jnp.arange(3), 4)\n"
            "try:\n    import jax_rope.nn\nexcept ImportError as e:\n    print('ERR', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert "ERR" in result.stdout and "jax_rope[flax]" in result.stdout, result.stdout


def test_rotary_embedding_from_config_matches_transformers():
    """A Phi-3.5-style config as it is (longrope, partial rotary, original length at the top
    level) gives transformers' cos/sin, for short and long sequences, traced under nnx.jit."""
    torch = pytest.importorskip("torch", reason="the optional extra 'hf'")
    transformers = pytest.importorskip("transformers", reason="the optional extra 'hf'")
    config = {"model_type": "phi3", "hidden_size": 96, "num_attention_heads": 3,
              "max_position_embeddings": 256, "original_max_position_embeddings": 32,
              "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
              "rope_scaling": {"type": "longrope",
                               "short_factor": [1.0 + 0.1 * i for i in range(12)],
                               "long_factor": [1.5 + 0.5 * i for i in range(12)]}}
    rotary = RotaryEmbedding.from_config(config)
    assert rotary.rotary_dim == 24
    hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(
        transformers.Phi3Config(**config))
    table = nnx.jit(lambda r, p: r(p))
    for length in (20, 100):  # short factors, then long ones (and the attention factor)
        positions = np.arange(length)[None]
        cos, sin = table(rotary, jnp.asarray(positions))
        ref_cos, ref_sin = hf(torch.zeros(1, dtype=torch.float32), torch.tensor(positions))
        # transformers rounds the angle position * inv_freq to float32 (error ~ position *
        # 6e-8); jax_rope reduces the phase exactly, so they differ by that much.
        np.testing.assert_allclose(cos, ref_cos.numpy(), atol=1e-7 * length + 1e-6)
        np.testing.assert_allclose(sin, ref_sin.numpy(), atol=1e-7 * length + 1e-6)


def test_rotary_embedding_rejects_bad_arguments_at_construction():
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(7)
    with pytest.raises(TypeError, match="scaling"):
        RotaryEmbedding(8, scaling=[("rope_type", "linear")])
    with pytest.raises(ValueError, match="factor"):
        RotaryEmbedding(8, scaling={"rope_type": "linear"})


@pytest.mark.parametrize("case", ["causal", "band", "mask", "prefix", "packed"])
def test_attention_matches_oracle(case, backend):
    rng = np.random.default_rng(1)
    B, S = 2, 6
    kw, call = {}, {}
    positions = np.broadcast_to(np.arange(S), (B, S))
    x = rng.normal(size=(B, S, H)).astype(np.float32)
    if case == "causal":
        kw = dict(sparse_mode=2, qkv_bias=True)
        positions = np.stack([np.arange(S), np.arange(S) + 5])     # per-row positions (B, S)
        call["positions"] = positions
    elif case == "band":
        kw = dict(sparse_mode=4, pre_tokens=2, next_tokens=0, scale=0.3)
    elif case == "mask":
        call["atten_mask"] = rng.random((B, 1, S, S)) < 0.3
        kw = dict(sparse_mode=0)
    elif case == "prefix":
        call["prefix"] = [2, 4]
        kw = dict(sparse_mode=6)
    layer = make_layer(scaling={"rope_type": "linear", "factor": 2.0}, **kw)
    attention_kw = {k: v for k, v in kw.items() if k in ("sparse_mode", "pre_tokens",
                                                          "next_tokens", "scale")}
    attention_kw.update({k: v for k, v in call.items() if k != "positions"})
    if case == "packed":
        layer = make_layer(sparse_mode=3)
        ends = np.array([2, 2, 7, 10], np.int32)                    # one empty sequence
        x = rng.normal(size=(10, H)).astype(np.float32)
        positions = np.array([0, 1, 0, 1, 2, 3, 4, 0, 1, 2])
        call = {"actual_seq_qlen": jnp.asarray(ends)}
        attention_kw = dict(sparse_mode=3, actual_seq_qlen=ends, actual_seq_kvlen=ends)
    # traced: x, positions, the TND lengths; prefix is a host list (as on the NPU): closed over
    static = {k: v for k, v in call.items() if k == "prefix"}
    traced = {k: v for k, v in call.items() if k != "prefix"}
    out = nnx.jit(lambda m, x, **c: m(x, **c, **static))(layer, jnp.asarray(x), **traced)
    assert out.shape == x.shape
    assert_close(out, reference(layer, x, positions, **attention_kw))


@pytest.mark.parametrize("mode,kw,backend", [
    (2, {}, "ffi"), (2, {}, "fallback"), (4, dict(pre_tokens=2, next_tokens=0), "ffi")],
    indirect=["backend"])
def test_kv_cache_decoding_equals_the_whole_sequence(mode, kw, backend):
    """Prefill, single tokens and a two-token step through the cache equal one call on the
    whole sequence (bottom-right causal over the valid cache), one program per step shape."""
    rng = np.random.default_rng(2)
    layer = make_layer(sparse_mode=mode, qkv_bias=True, **kw)
    x = jnp.asarray(rng.normal(size=(2, 7, H)).astype(np.float32))
    whole = nnx.jit(lambda m, x: m(x))(layer, x)
    assert_close(whole, reference(layer, x, np.arange(7), sparse_mode=mode, **kw))
    layer.init_cache(2, 9)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    pieces = [step(layer, x[:, :3]), step(layer, x[:, 3:4]), step(layer, x[:, 4:6]),
              step(layer, x[:, 6:7])]
    assert int(layer.cache_length) == 7
    assert_close(jnp.concatenate(pieces, axis=1), whole, tol=1e-6)
    # past the cache's capacity: NaN, never a silently wrong answer
    overflow = step(layer, x[:, :3])
    assert np.isnan(np.asarray(overflow)).all()


def dense_attention_jnp(params, x, cos, sin, mask):
    """float32 jnp reference of the layer (no biases, half-mode RoPE), for gradients."""
    def heads(w, n):
        return (x @ w).reshape(x.shape[:-1] + (n, D))
    q, k, v = heads(params["q"], N1), heads(params["k"], N2), heads(params["v"], N2)

    def rope(t):
        r = cos.shape[-1]
        tr = t[..., :r]
        rot = jnp.concatenate([-tr[..., r // 2:], tr[..., :r // 2]], axis=-1)
        return jnp.concatenate([tr * cos + rot * sin, t[..., r:]], axis=-1)
    q, k = rope(q), rope(k)
    k, v = jnp.repeat(k, N1 // N2, axis=2), jnp.repeat(v, N1 // N2, axis=2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, -jnp.inf, s), axis=-1)
    out = jnp.einsum("bnqk,bknd->bqnd", p, v).reshape(x.shape[:-1] + (N1 * D,))
    return out @ params["o"]


def test_grad_under_nnx_jit_matches_dense_reference():
    rng = np.random.default_rng(3)
    layer = make_layer(rotary_dim=8, sparse_mode=2)
    x = jnp.asarray(rng.normal(size=(2, 5, H)).astype(np.float32))
    target = jnp.asarray(rng.normal(size=(2, 5, H)).astype(np.float32))

    @nnx.jit
    def loss_and_grad(model, x):
        return nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    loss, grads = loss_and_grad(layer, x)

    cos, sin = rope_tables_oracle.cos_sin(np.arange(5), 8)
    cos, sin = (jnp.asarray(t[None, :, None, :], jnp.float32) for t in (cos, sin))
    mask = jnp.asarray(attention_oracle.dense_mask(2, 5, 5))        # (1, 1, S, S)
    params = {"q": layer.q_proj.kernel[...], "k": layer.k_proj.kernel[...],
              "v": layer.v_proj.kernel[...], "o": layer.o_proj.kernel[...]}
    ref_loss, ref = jax.jit(jax.value_and_grad(
        lambda p: jnp.mean((dense_attention_jnp(p, x, cos, sin, mask) - target) ** 2)))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, proj in (("q", grads.q_proj), ("k", grads.k_proj), ("v", grads.v_proj),
                       ("o", grads.o_proj)):
        np.testing.assert_allclose(proj.kernel[...], ref[name], rtol=1e-4,
                                   atol=1e-4 * float(jnp.abs(ref[name]).max()), err_msg=name)


def test_layer_validation_names_the_argument():
    rotary = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        GroupedQueryAttention(H, 4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rotary_dim"):
        GroupedQueryAttention(H, 4, 2, 4, rotary=rotary, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sparse_mode"):
        GroupedQueryAttention(H, 4, 2, sparse_mode=9, rngs=nnx.Rngs(0))
    layer = make_layer()
    x = jnp.zeros((2, 5, H))
    with pytest.raises(ValueError, match=r"x must be \(B, S, H\)"):
        layer(jnp.zeros((5, H)))
    with pytest.raises(ValueError, match="positions"):
        layer(x, positions=jnp.arange(4))
    with pytest.raises(ValueError, match="init_cache"):
        layer(x, decode=True)
    masked = make_layer(sparse_mode=1)
    masked.init_cache(2, 8)
    with pytest.raises(ValueError, match="sparse_mode 1"):
        masked(x, decode=True, atten_mask=jnp.zeros((5, 8), bool))
    layer.init_cache(1, 8)
    with pytest.raises(ValueError, match="cache's batch 1"):
        layer(x, decode=True)
