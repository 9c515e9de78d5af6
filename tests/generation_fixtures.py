"""Shared setup for the generation tests: a tiny model, a small bucket file and transformers' reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxserve import LLM
from tests.hf_tiny import make_tiny_model

# Small grid: 2 decode + 2 prefill executables, 8-token blocks so forks and copy-on-write are frequent.
BUCKETS = """block_size = 8
[decode]
batch_sizes = [4, 8]
[prefill]
batch_sizes = [1]
lengths = [16, 64]
[context]
lengths = [128]
"""
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 64
EOS = 2
LETTERS = {ch: 67 + i for i, ch in enumerate("abcdefghij")}  # the byte-level tokenizer's ids of a-j


def build_llm(tmp_path: Path, seed: int = 1) -> tuple[Path, LLM]:
    model_dir = make_tiny_model(tmp_path / "model", "llama", seed=seed)
    buckets = tmp_path / "buckets.toml"
    buckets.write_text(BUCKETS)
    return model_dir, LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, buckets=str(buckets),
                          num_kv_blocks=NUM_KV_BLOCKS)


class HFReference:
    """transformers' float32 model, loaded once: logits and log_softmax of every position."""

    def __init__(self, model_dir: Path):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(self, token_ids: list[int]) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.tensor([token_ids])).logits[0].numpy().astype(np.float64)

    def logprobs(self, token_ids: list[int]) -> np.ndarray:
        shifted = self.logits(token_ids)
        shifted -= shifted.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def tokens_prompt(token_ids: list[int]) -> dict:
    return {"prompt_token_ids": list(token_ids)}
