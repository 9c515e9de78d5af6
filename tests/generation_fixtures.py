"""Shared setup for the generation tests: a tiny model, a small bucket file and transformers' reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxserve import LLM
from jaxserve.testing.tiny_models import make_tiny_model

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
    return model_dir, llm_on_buckets(model_dir, tmp_path, "buckets", BUCKETS)


def llm_on_buckets(model_dir: Path, tmp_path: Path, name: str, buckets: str, *, num_kv_blocks: int = NUM_KV_BLOCKS,
                   **kwargs) -> LLM:
    """A float32 engine of the tiny model on the bucket file `buckets` (written as `tmp_path/name.toml`)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(buckets)
    return LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, buckets=str(path),
               num_kv_blocks=num_kv_blocks, **kwargs)


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


def record_planned_ahead(engine) -> list[bool]:
    """From now on, whether each of ``engine``'s steps left its step unread (async scheduling planned the next one
    ahead of it), in order."""
    step, planned_ahead = engine.step, []

    def recording_step():
        outputs = step()
        planned_ahead.append(engine._in_flight is not None)
        return outputs

    engine.step = recording_step
    return planned_ahead
