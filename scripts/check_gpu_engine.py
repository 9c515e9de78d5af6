"""The engine on a GPU: the Pallas (Triton) attention backend gives the reference backend's greedy tokens and
transformers' on the same tiny random Llama, on prefill, decode and mixed steps.

What tests/runner/test_pallas_engine.py checks in interpret mode on CPU, compiled for real on the GPU the jax
backend is: in float32 the Pallas backend's tokens must equal the reference backend's and transformers' float32
greedy continuation (exit status 1 otherwise); in bfloat16 the kernels round the softmax weights to bfloat16 for
the P @ V product and the reference does not, so on a random model greedy paths may part: the share of equal
tokens is reported, not required.

    python scripts/check_gpu_engine.py            # on a GPU machine
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one

from jaxserve.testing.hf_reference import hf_greedy  # noqa: E402
from jaxserve.testing.small_buckets import small_bucket_file  # noqa: E402
from jaxserve.testing.tiny_models import TINY_64, make_tiny_model  # noqa: E402

PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 300))]  # across pages; short; prefilled in chunks
MAX_TOKENS = 12


def engine_tokens(model_dir: Path, backend: str, dtype: str) -> tuple[list[list[int]], dict]:
    from jaxserve import LLM, SamplingParams

    buckets = small_bucket_file(model_dir, (4,), mixed=True, chunk=64, context=512)
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
              attention_backend=backend, buckets=buckets, num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner, stats = llm.llm_engine.runner, llm.llm_engine.stats
    info = {"backend": runner.backend.name, "pool": tuple(runner.kv_pool[0].shape), "prefill": stats.num_prefill_steps,
            "decode": stats.num_decode_steps, "mixed": stats.num_mixed_steps}
    return tokens, info


def main() -> None:
    import jax

    print(f"jax {jax.__version__} on {jax.devices()}")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp), "llama", seed=3, **TINY_64)
        expected = [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]
        for dtype in ("float32", "bfloat16"):
            results = {}
            for backend in ("reference", "pallas"):
                try:
                    results[backend], info = engine_tokens(model_dir, backend, dtype)
                    print(f"{dtype} {backend}: {info} tokens {results[backend]}", flush=True)
                except Exception as error:  # noqa: BLE001  (report every failure, then go on)
                    failures.append(f"{dtype} {backend}: {type(error).__name__}: {error}")
                    print(f"FAILED {failures[-1]}", flush=True)
            if "pallas" in results and "reference" in results:
                same = sum(a == b for x, y in zip(results["pallas"], results["reference"], strict=True)
                           for a, b in zip(x, y, strict=True))
                print(f"{dtype}: {same} of {len(PROMPTS) * MAX_TOKENS} tokens equal to the reference backend's")
                if dtype == "float32" and results["pallas"] != results["reference"]:
                    failures.append("float32: pallas tokens differ from the reference backend's")
            if dtype == "float32" and results.get("pallas", expected) != expected:
                failures.append(f"float32 pallas tokens differ from transformers' {expected}")
    if failures:
        raise SystemExit("\n".join(failures))
    print("the GPU kernels' engine gives the reference backend's and transformers' tokens")


if __name__ == "__main__":
    main()
