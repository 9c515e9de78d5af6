"""A Hugging Face model directory of a real model's shape with seeded random weights, for benchmarks on a
machine without the real checkpoint (the GPU box has no model hub).

Writes config.json, safetensors in the chosen dtype and the tests' byte-level tokenizer (`jaxserve.testing`;
prompts are given as token ids; the model's vocabulary stays the real one). The weights come from transformers'
own initialisation (normal, std `initializer_range`), made on the GPU when there is one.

    python scripts/make_random_model.py llama-3.2-1b /tmp/llama-1b            # bfloat16
    python scripts/make_random_model.py smollm2-135m /tmp/smol --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one

# Shapes of the real configs (Hugging Face's config.json values that set the compute and memory)
PRESETS = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}


def make_random_model(preset: str, out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    import torch
    import transformers

    from jaxserve.testing.tiny_models import byte_level_tokenizer

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**PRESETS[preset])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out)
    byte_level_tokenizer().save_pretrained(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_random_model(args.preset, args.out, args.dtype, args.seed)
    print(f"{args.preset} ({args.dtype}, random, seed {args.seed}) -> {path}")


if __name__ == "__main__":
    main()
