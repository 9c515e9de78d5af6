"""The reference of the multi-host serving test: one process, four CPU devices, the same tensor-parallel engine.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.distributed.four_device_reference \
        MODEL_DIR BUCKETS OUT_JSON PROMPT...

Writes the greedy completion (ids and text, special tokens kept) of each prompt, `MAX_TOKENS` tokens ignoring EOS.
"""

from __future__ import annotations

import json
import sys

MAX_TOKENS = 12


def main(model_dir: str, buckets: str, out_json: str, *prompts: str) -> None:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, skip_special_tokens=False)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    completions = [{"token_ids": o.outputs[0].token_ids, "text": o.outputs[0].text} for o in outputs]
    with open(out_json, "w") as f:
        json.dump(completions, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
