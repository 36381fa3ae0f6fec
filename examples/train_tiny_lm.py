"""Trains the tiny RoPE + causal-attention character model of notebooks/03_training.ipynb.

    python examples/train_tiny_lm.py [--steps 300] [--backend auto|ffi|fallback]

Prints a text progress bar, the start and final loss (nats per character), the time
per step, and a short greedy sample. Exits with status 1 if the final loss (mean of the
last 20 steps) is not below the first one, so a smoke run can check that it learns.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny_lm.py beside this file

import jax_rope as jr  # noqa: E402

import tiny_lm  # noqa: E402


class ProgressBar:
    """`[#######.......]  42/100 loss 2.345  17.1 steps/s`, redrawn in place on a terminal;
    elsewhere (a pipe, a log file) one line per tenth of the run."""

    def __init__(self, total: int, width: int = 30, stream=sys.stdout):
        self.total, self.width, self.stream = total, width, stream
        self.live = stream.isatty()
        self.start = time.perf_counter()
        self.last_tenth = -1

    def update(self, step: int, loss: float) -> None:
        done = int(self.width * step / self.total)
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        line = (f"[{'#' * done}{'.' * (self.width - done)}] {step:>{len(str(self.total))}}/"
                f"{self.total} loss {loss:.3f} {rate:6.1f} steps/s")
        if self.live:
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
        else:
            tenth = 10 * step // self.total
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            self.stream.write(line + "\n")
        self.stream.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--backend", choices=("auto", "ffi", "fallback"), default=None,
                        help="jax_rope backend (default: JAX_ROPE_BACKEND, else auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", type=int, default=120,
                        help="characters of greedy sample to print (0: none)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.backend is not None:
        jr.set_backend(args.backend)
    config = tiny_lm.Config(seed=args.seed)
    corpus = tiny_lm.Corpus.load()
    print(f"jax_rope {jr.__version__}, backend {jr.describe(as_dict=True)['backend']}; "
          f"{len(corpus.text)} characters, vocabulary {corpus.vocab_size}; "
          f"{config.layers} layers, model dim {config.model_dim}, heads "
          f"{config.q_heads}q/{config.kv_heads}kv x {config.head_dim}, "
          f"batch {config.batch} x {config.seq_len}")
    bar = ProgressBar(args.steps)
    result = tiny_lm.train(config, args.steps, on_step=bar.update, corpus=corpus)
    first, final = result.losses[0], tiny_lm.final_loss(result.losses)
    print(f"loss: first step {first:.3f}, final {final:.3f} (mean of the last "
          f"{min(20, len(result.losses))} steps), ratio {final / first:.2f}")
    print(f"time: {result.seconds:.1f} s for {args.steps} steps including compilation; "
          f"{tiny_lm.step_time_ms(result):.1f} ms per compiled step")
    if args.sample > 0:
        print("sample:", repr(tiny_lm.generate(result, "The ", args.sample)))
    if not final < first:
        print("error: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
