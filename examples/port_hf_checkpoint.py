"""Ports a Hugging Face Llama-family checkpoint to the jax_rope Flax layers and generates.

    python examples/port_hf_checkpoint.py CHECKPOINT_DIR [--prompt-ids 1 2 3] [--text "Hi"]
                                          [--new-tokens 8] [--compare]
    python examples/port_hf_checkpoint.py --tiny llama|qwen2|phi3 [--compare]

CHECKPOINT_DIR holds `config.json` and `*.safetensors` (as `save_pretrained` or the Hub writes
them); llama, mistral, qwen2 and phi3 model types. `--tiny FAMILY` builds a tiny random model
with transformers in a temporary directory first (no network). `--text` needs the checkpoint's
tokenizer and transformers; `--compare` runs transformers (torch CPU) on the same prompt and
prints the largest logit difference relative to the largest logit. Exits with status 1 if the
comparison shows a relative difference above 1e-4 or different tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # modules beside this file

import numpy as np  # noqa: E402

import hf_llama  # noqa: E402


def transformers_greedy(path, prompt: np.ndarray, new_tokens: int):
    """(tokens, step logits) of transformers' own greedy generation, in float32 (eager)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor(prompt)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    return out.sequences.numpy(), torch.stack(out.logits, dim=1).numpy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory")
    parser.add_argument("--tiny", choices=("llama", "qwen2", "phi3"),
                        help="build a tiny random checkpoint of this family first")
    parser.add_argument("--prompt-ids", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--text", help="a text prompt (uses the checkpoint's tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--compare", action="store_true",
                        help="compare logits and tokens with transformers")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (args.tiny is None):
        parser.error("give a checkpoint directory or --tiny FAMILY (one of them)")
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    path = args.checkpoint
    if args.tiny:
        import tiny_hf_checkpoints

        path = tempfile.mkdtemp(prefix=f"tiny_{args.tiny}_")
        tiny_hf_checkpoints.make_tiny_checkpoint(args.tiny, path)
        print(f"tiny random {args.tiny} checkpoint written to {path}")

    tokenizer = None
    if args.text is not None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        prompt = np.array([tokenizer(args.text)["input_ids"]], np.int32)
    else:
        prompt = np.array([args.prompt_ids], np.int32)

    start = time.perf_counter()
    model = hf_llama.load_checkpoint(path)
    c = model.config
    print(f"loaded {c.model_type}: {c.num_layers} layers, hidden {c.hidden_size}, heads "
          f"{c.num_heads}q/{c.num_kv_heads}kv x {c.head_dim}, vocab {c.vocab_size}, "
          f"tied embeddings {c.tie_word_embeddings} ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    tokens, logits = hf_llama.generate(model, prompt, args.new_tokens)
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    print(f"generated {args.new_tokens} tokens in {time.perf_counter() - start:.1f} s "
          f"(compilation included): {tokens[0].tolist()}")
    if tokenizer is not None:
        print("text:", repr(tokenizer.decode(tokens[0])))
    if not args.compare:
        return 0
    ref_tokens, ref_logits = transformers_greedy(path, prompt, args.new_tokens)
    relative = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
    same = bool((tokens == ref_tokens).all())
    print(f"transformers: same tokens {same}, largest logit difference / largest logit "
          f"{relative:.2e}")
    return 0 if same and relative <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
