"""A tiny decoder-only character language model built on jax_rope's Flax NNX layers.

Every block attends with `jax_rope.nn.GroupedQueryAttention` (sparse_mode=2, the NPU's
leftUpCausal mask; 4 query heads share 2 key/value heads), which rotates its queries and keys
with the fused `apply_rotary_pos_emb` using the tables of a shared
`jax_rope.nn.RotaryEmbedding` (there is no position table: RoPE is the only position signal).
Trained with `nnx.value_and_grad` and an optax Adam `nnx.Optimizer` under `nnx.jit` on
`tiny_corpus.txt`; sampling goes through the layers' key/value cache.

Used by `examples/train_tiny_lm.py` (the command line) and
`notebooks/03_training.ipynb`; nothing here prints.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_rope.nn import GroupedQueryAttention, RotaryEmbedding

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
# The model: jax_rope.nn layers
# ---------------------------------------------------------------------------------------------

class Block(nnx.Module):
    """Pre-RMSNorm residual block: causal grouped-query attention with RoPE, then a GELU MLP."""

    def __init__(self, c: Config, rotary: RotaryEmbedding, rngs: nnx.Rngs):
        depth = 1.0 / math.sqrt(2 * c.layers)  # residual branches start small
        self.attn_norm = nnx.RMSNorm(c.model_dim, rngs=rngs)
        self.attn = GroupedQueryAttention(c.model_dim, c.q_heads, c.kv_heads, c.head_dim,
                                          rotary=rotary, sparse_mode=2, rngs=rngs)
        self.attn.o_proj.kernel[...] *= depth
        self.mlp_norm = nnx.RMSNorm(c.model_dim, rngs=rngs)
        self.w_in = nnx.Linear(c.model_dim, c.mlp_dim, use_bias=False, rngs=rngs)
        self.w_out = nnx.Linear(c.mlp_dim, c.model_dim, use_bias=False, rngs=rngs)
        self.w_out.kernel[...] *= depth

    def __call__(self, x, decode: bool = False):
        x = x + self.attn(self.attn_norm(x), decode=decode)
        return x + self.w_out(jax.nn.gelu(self.w_in(self.mlp_norm(x))))


class TinyLM(nnx.Module):
    """Next-character logits (B, S, vocab) for int tokens (B, S). RoPE is the only position
    signal; the unembedding starts at zero, so the first loss is exactly log(vocab_size)."""

    def __init__(self, config: Config, vocab_size: int, rngs: nnx.Rngs):
        c = config
        rotary = RotaryEmbedding(c.head_dim, base=c.rope_base)  # shared by every layer
        self.embed = nnx.Embed(vocab_size, c.model_dim,
                               embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.blocks = nnx.List([Block(c, rotary, rngs) for _ in range(c.layers)])
        self.final_norm = nnx.RMSNorm(c.model_dim, rngs=rngs)
        self.unembed = nnx.Linear(c.model_dim, vocab_size, use_bias=False,
                                  kernel_init=nnx.initializers.zeros, rngs=rngs)

    def init_cache(self, batch: int, max_length: int) -> None:
        for block in self.blocks:
            block.attn.init_cache(batch, max_length)

    def __call__(self, tokens, decode: bool = False):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, decode)
        return self.unembed(self.final_norm(x))


def make_model(config: Config, vocab_size: int) -> TinyLM:
    return TinyLM(config, vocab_size, nnx.Rngs(config.seed))


def loss_fn(model: TinyLM, tokens, targets):
    """Mean cross-entropy (nats per character) of predicting `targets`."""
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


eval_loss = nnx.jit(loss_fn)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def make_optimizer(model: TinyLM, config: Config) -> nnx.Optimizer:
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(config.learning_rate))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def make_train_step():
    """A step (model, optimizer, tokens, targets) -> loss under nnx.jit, updating the model and
    the optimizer state in place.

    The jax_rope backend is part of jit's cache key: calling the same step inside
    `with jr.backend("fallback")` traces and compiles it again for that backend.
    """
    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss
    return train_step


@dataclasses.dataclass
class TrainResult:
    model: TinyLM
    losses: list[float]
    corpus: Corpus
    config: Config
    seconds: float                  # wall time of all steps, compilation included
    train_step: Callable            # the jitted step, for timing it elsewhere
    optimizer: nnx.Optimizer


def train(config: Config = Config(), steps: int = 300,
          on_step: Callable[[int, float], None] | None = None,
          corpus: Corpus | None = None) -> TrainResult:
    """Trains from scratch for `steps` steps; `on_step(step, loss)` after each (1-based)."""
    corpus = corpus or Corpus.load()
    model = make_model(config, corpus.vocab_size)
    optimizer = make_optimizer(model, config)
    train_step = make_train_step()
    rng = np.random.default_rng(config.seed)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens, targets = corpus.batch(rng, config.batch, config.seq_len)
        loss = train_step(model, optimizer, tokens, targets)
        losses.append(float(loss))  # float() waits for the step: honest timings
        if on_step is not None:
            on_step(step, losses[-1])
    return TrainResult(model, losses, corpus, config, time.perf_counter() - start,
                       train_step, optimizer)


def final_loss(losses: list[float], window: int = 20) -> float:
    """The mean of the last `window` losses (one batch is noisy)."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def step_time_ms(result: TrainResult, repeats: int = 5) -> float:
    """Median wall time (ms) of one compiled training step under the current backend
    (the first call, which may compile, is not counted), on copies: the trained model is
    not updated."""
    tokens, targets = result.corpus.batch(np.random.default_rng(1), result.config.batch,
                                          result.config.seq_len)
    model, optimizer = nnx.clone((result.model, result.optimizer))
    jax.block_until_ready(result.train_step(model, optimizer, tokens, targets))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(result.train_step(model, optimizer, tokens, targets))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


@nnx.jit
def _next_logits(model: TinyLM, tokens):
    return model(tokens, decode=True)[0, -1]


def generate(result: TrainResult, prompt: str, length: int = 120) -> str:
    """Greedy continuation of `prompt` (characters of the corpus only), one character per step
    through the layers' key/value cache.

    The model was trained on windows of seq_len characters, so the cache holds at most that
    many: when it is full, it restarts from the last seq_len // 2 characters (positions from 0
    again, as in training).
    """
    corpus, seq_len = result.corpus, result.config.seq_len
    model = nnx.clone(result.model)  # the cache is state: keep it off the trained model
    ids = list(corpus.encode(prompt))
    step = ids[-seq_len:]
    model.init_cache(1, seq_len)
    for _ in range(length):
        if int(model.blocks[0].attn.cache_length) + len(step) > seq_len:
            model.init_cache(1, seq_len)
            step = ids[-(seq_len // 2):]
        logits = _next_logits(model, np.array([step], np.int32))
        ids.append(int(jnp.argmax(logits)))
        step = ids[-1:]
    return corpus.decode(ids)
