"""A tiny decoder-only character language model built on jax_rope.

Every attention layer rotates its queries and keys with `jr.rope_cos_sin` +
`jr.apply_rotary_pos_emb` (there is no position table: RoPE is the only position
signal) and attends with `jr.flash_attention_score(..., sparse_mode=2)`, the
NPU's leftUpCausal mask. Grouped-query attention: 4 query heads share 2 key/value
heads. Trained with `jax.value_and_grad` and optax on `tiny_corpus.txt`.

Used by `examples/train_tiny_lm.py` (the command line) and
`notebooks/03_training.ipynb`; nothing here prints.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_rope as jr

CORPUS_PATH = pathlib.Path(__file__).with_name("tiny_corpus.txt")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training sizes (frozen: hashable, so jit can treat it as static)."""
    seq_len: int = 64
    batch: int = 16
    model_dim: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    rope_base: float = 10000.0
    learning_rate: float = 3e-3
    seed: int = 0


class Corpus:
    """A text as character ids, with random training windows."""

    def __init__(self, text: str):
        self.text = text
        self.vocab = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.vocab)}
        self.ids = np.array([self.index[ch] for ch in text], np.int32)

    @classmethod
    def load(cls, path=CORPUS_PATH) -> "Corpus":
        return cls(pathlib.Path(path).read_text(encoding="utf-8"))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[ch] for ch in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int):
        """(tokens, targets), each (batch, seq_len) int32: targets are tokens shifted by one."""
        starts = rng.integers(0, len(self.ids) - seq_len - 1, size=batch)
        windows = np.stack([self.ids[s:s + seq_len + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

def init_params(key, config: Config, vocab_size: int) -> dict:
    """Parameters as a pytree of float32 arrays; the unembedding starts at zero, so the
    first loss is exactly log(vocab_size)."""
    c = config
    keys = iter(jax.random.split(key, 1 + 6 * c.layers))

    def dense(fan_in, *shape):
        return jax.random.normal(next(keys), (fan_in, *shape)) / math.sqrt(fan_in)

    layers = []
    for _ in range(c.layers):
        layers.append({
            "attn_norm": jnp.ones((c.model_dim,)),
            "wq": dense(c.model_dim, c.q_heads, c.head_dim),
            "wk": dense(c.model_dim, c.kv_heads, c.head_dim),
            "wv": dense(c.model_dim, c.kv_heads, c.head_dim),
            "wo": dense(c.q_heads * c.head_dim, c.model_dim).reshape(
                c.q_heads, c.head_dim, c.model_dim) / math.sqrt(2 * c.layers),
            "mlp_norm": jnp.ones((c.model_dim,)),
            "w_in": dense(c.model_dim, c.mlp_dim),
            "w_out": dense(c.mlp_dim, c.model_dim) / math.sqrt(2 * c.layers),
        })
    return {
        "embed": jax.random.normal(next(keys), (vocab_size, c.model_dim)),
        "layers": layers,
        "final_norm": jnp.ones((c.model_dim,)),
        "unembed": jnp.zeros((c.model_dim, vocab_size)),
    }


def rms_norm(x, scale, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope_tables(seq_len: int, config: Config):
    """Half-mode cos/sin for positions 0..S-1, shaped (1, S, 1, head_dim) for BSND."""
    positions = jnp.arange(seq_len)[None, :]                       # (1, S): broadcast over B
    cos, sin = jr.rope_cos_sin(positions, config.head_dim, base=config.rope_base)
    return cos[:, :, None, :], sin[:, :, None, :]


def attention(layer: dict, x, cos, sin):
    """Causal self-attention with RoPE: x (B, S, model_dim) -> (B, S, model_dim)."""
    q = jnp.einsum("bsm,mnd->bsnd", x, layer["wq"])                # (B, S, Nq, D)
    k = jnp.einsum("bsm,mnd->bsnd", x, layer["wk"])                # (B, S, Nk, D)
    v = jnp.einsum("bsm,mnd->bsnd", x, layer["wv"])
    q, k = jr.apply_rotary_pos_emb(q, k, cos, sin, layout="BSND", rotary_mode="half")
    out, _, _ = jr.flash_attention_score(q, k, v, input_layout="BSND", sparse_mode=2)
    return jnp.einsum("bsnd,ndm->bsm", out, layer["wo"])


def mlp(layer: dict, x):
    return jax.nn.gelu(x @ layer["w_in"]) @ layer["w_out"]


def forward(params: dict, tokens, config: Config):
    """Next-character logits (B, S, vocab) for int tokens (B, S)."""
    cos, sin = rope_tables(tokens.shape[1], config)
    x = params["embed"][tokens]
    for layer in params["layers"]:
        x = x + attention(layer, rms_norm(x, layer["attn_norm"]), cos, sin)
        x = x + mlp(layer, rms_norm(x, layer["mlp_norm"]))
    return rms_norm(x, params["final_norm"]) @ params["unembed"]


def loss_fn(params: dict, tokens, targets, config: Config):
    """Mean cross-entropy (nats per character) of predicting `targets`."""
    logits = forward(params, tokens, config)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def make_optimizer(config: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(config.learning_rate))


def make_train_step(config: Config, optimizer: optax.GradientTransformation):
    """A jitted step (params, opt_state, tokens, targets) -> (params, opt_state, loss).

    The jax_rope backend is part of jit's cache key: calling the same step inside
    `with jr.backend("fallback")` traces and compiles it again for that backend.
    """
    @jax.jit
    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


@dataclasses.dataclass
class TrainResult:
    params: dict
    losses: list[float]
    corpus: Corpus
    config: Config
    seconds: float                  # wall time of all steps, compilation included
    train_step: Callable            # the jitted step, for timing it elsewhere
    opt_state: object


def train(config: Config = Config(), steps: int = 300,
          on_step: Callable[[int, float], None] | None = None,
          corpus: Corpus | None = None) -> TrainResult:
    """Trains from scratch for `steps` steps; `on_step(step, loss)` after each (1-based)."""
    corpus = corpus or Corpus.load()
    params = init_params(jax.random.key(config.seed), config, corpus.vocab_size)
    optimizer = make_optimizer(config)
    opt_state = optimizer.init(params)
    train_step = make_train_step(config, optimizer)
    rng = np.random.default_rng(config.seed)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens, targets = corpus.batch(rng, config.batch, config.seq_len)
        params, opt_state, loss = train_step(params, opt_state, tokens, targets)
        losses.append(float(loss))  # float() waits for the step: honest timings
        if on_step is not None:
            on_step(step, losses[-1])
    return TrainResult(params, losses, corpus, config, time.perf_counter() - start,
                       train_step, opt_state)


def final_loss(losses: list[float], window: int = 20) -> float:
    """The mean of the last `window` losses (one batch is noisy)."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def step_time_ms(result: TrainResult, repeats: int = 5) -> float:
    """Median wall time (ms) of one compiled training step under the current backend
    (the first call, which may compile, is not counted). Parameters are not updated."""
    tokens, targets = result.corpus.batch(np.random.default_rng(1), result.config.batch,
                                          result.config.seq_len)
    args = (result.params, result.opt_state, tokens, targets)
    jax.block_until_ready(result.train_step(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(result.train_step(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


@functools.partial(jax.jit, static_argnames="config")
def _next_logits(params, window, length, config: Config):
    return forward(params, window[None, :], config)[0, length - 1]


def generate(result: TrainResult, prompt: str, length: int = 120) -> str:
    """Greedy continuation of `prompt` (characters of the corpus only).

    The last seq_len characters are padded on the right to a fixed window, so one
    compiled forward serves every step; the causal mask keeps the padding unseen.
    """
    corpus, seq_len = result.corpus, result.config.seq_len
    ids = list(corpus.encode(prompt))
    for _ in range(length):
        context = ids[-seq_len:]
        window = np.zeros(seq_len, np.int32)
        window[:len(context)] = context
        logits = _next_logits(result.params, window, len(context), result.config)
        ids.append(int(jnp.argmax(logits)))
    return corpus.decode(ids)
