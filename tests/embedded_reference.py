"""transformers' float32 SmolLM2-135M-Instruct (the embedded GGUF) as the reference of the embedded-model tests:
greedy continuations of the shared chats with each step's logits, computed once per test session."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from jaxserve.weights import embedded_model_path

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
CHATS = WORKLOADS / "chat_questions.jsonl"
NEW_TOKENS = 32


def chats() -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in CHATS.read_text().splitlines() if line.strip()]


@functools.cache
def hf_model():
    import torch
    import transformers

    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@functools.cache
def hf_greedy(prompt_ids: tuple[int, ...], eos_id: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding of up to NEW_TOKENS tokens with transformers (KV cache, float32), stopping at EOS;
    returns the tokens and each step's logits f32[steps, V]."""
    import torch

    ids, out, step_logits = list(prompt_ids), [], []
    past = None
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            feed = torch.tensor([ids[-1:]] if past is not None else [ids])
            result = hf_model()(feed, past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1].numpy()
            token = int(logits.argmax())
            step_logits.append(logits)
            out.append(token)
            ids.append(token)
            if token == eos_id:
                break
    return out, np.stack(step_logits)


def top2_gap(logits: np.ndarray) -> float:
    """The float32 logit margin of the argmax over the runner-up."""
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])
