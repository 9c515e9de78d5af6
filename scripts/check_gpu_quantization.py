"""Quantized weights and the float8 and int8 KV caches on this machine's accelerator (a GPU: the device machine):
every scheme's greedy tokens, and the KV caches', against transformers computing what the engine resolved here
computes, on a tiny random float32 Llama (head_dim 64, so the Pallas kernels run on GPU and TPU).

The references are the tests' (tests/quantization's, from `jaxserve.testing`): weights dequantized and, where the
scheme quantizes activations (fp8 on GPUs of compute capability 8.9+), each quantized layer's input rounded per
token; a float8 KV cache as transformers' cache rounding K/V to e4m3 (with a checkpoint's K/V scales: K / k_scale
rounded), an int8 one as a cache quantizing each token's row per kv head to int8 times its scale; `gguf` (its
group-by-group products, as on any GPU) on a GGUF file of the model, which transformers dequantizes. Prints each
run's tokens and whether they are equal; exit status 1 if any run fails or differs.

    python scripts/check_gpu_quantization.py   # PYTHONPATH=. on the device machine (qwix and gguf carried as wheels)
    python scripts/check_gpu_quantization.py none:int8 fp8:int8   # some runs: weights:kv_cache_dtype
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.testing.hf_reference import greedy_continuation  # noqa: E402
from jaxserve.testing.quantized_references import MAX_TOKENS, PROMPTS, hf_quantized  # noqa: E402
from jaxserve.testing.rounding_caches import (  # noqa: E402
    KV_SCALES,
    Fp8RoundingCache,
    Int8RoundingCache,
    ScaledFp8RoundingCache,
)
from jaxserve.testing.small_buckets import small_bucket_file  # noqa: E402
from jaxserve.testing.tiny_models import TINY_64, make_tiny_model  # noqa: E402
from jaxserve.weights.compressed_tensors import write_kv_cache_scales  # noqa: E402

RUNS = [("int8", "auto"), ("int8_w8a8", "auto"), ("fp8", "auto"), (None, "fp8"), ("fp8", "fp8"), ("gguf", "auto"),
        ("kv scales", "fp8"), (None, "int8"), ("fp8", "int8")]
ROUNDING_CACHES = {"fp8": Fp8RoundingCache, "int8": Int8RoundingCache}  # transformers' cache per kv_cache_dtype


def engine_tokens(model_dir: Path, work: Path, quantization: str | None, kv_cache_dtype: str):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64,
              buckets=small_bucket_file(work, decode_batch_sizes=(2,), mixed=True, chunk=16, context=128))
    runner = llm.llm_engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], runner.config.quantization, runner.backend.name


def reference_tokens(model_dir: Path, scheme, kv_cache_dtype: str, cache_class=None, model=None) -> list[list[int]]:
    if model is None and scheme is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    elif model is None:
        model = hf_quantized(model_dir, scheme)
    cache_class = cache_class or ROUNDING_CACHES.get(kv_cache_dtype)
    return [greedy_continuation(model, prompt, MAX_TOKENS, cache_class and cache_class(config=model.config))
            for prompt in PROMPTS]


def run(model_dir: Path, work: Path, quantization: str | None, kv_cache_dtype: str):
    """(engine tokens, reference tokens, what the engine resolved) of one run."""
    if quantization == "gguf":  # the model as a GGUF file in the kept block types; transformers reads the file
        from jaxserve.testing.tiny_gguf import QUANTIZED_LAYER_TYPES, make_tiny_gguf

        path = make_tiny_gguf(work / "tiny.gguf", model_dir, QUANTIZED_LAYER_TYPES)
        ours, scheme, backend = engine_tokens(path, work, "gguf", kv_cache_dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(work, gguf_file=path.name, dtype=torch.float32)
        return ours, reference_tokens(model_dir, None, kv_cache_dtype, model=model.eval()), (scheme, backend)
    if quantization == "kv scales":  # a checkpoint's float8 K/V scales
        scaled = write_kv_cache_scales(Path(shutil.copytree(model_dir, work / "scaled")), KV_SCALES)
        ours, scheme, backend = engine_tokens(scaled, work, None, kv_cache_dtype)
        return ours, reference_tokens(model_dir, None, kv_cache_dtype, ScaledFp8RoundingCache), (scheme, backend)
    ours, scheme, backend = engine_tokens(model_dir, work, quantization, kv_cache_dtype)
    return ours, reference_tokens(model_dir, scheme, kv_cache_dtype), (scheme, backend)


def main() -> None:
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind}, compute capability "
          f"{getattr(device, 'compute_capability', None)}", flush=True)
    failures = []
    chosen = [tuple(None if part == "none" else part for part in run.split(":")) for run in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "llama", "llama", seed=11, **TINY_64)
        for quantization, kv_cache_dtype in chosen or RUNS:
            name = f"weights {quantization or 'float32'}, KV {kv_cache_dtype}"
            try:
                ours, theirs, (scheme, backend) = run(model_dir, Path(tmp), quantization, kv_cache_dtype)
                print(f"{name}: {scheme}, {backend} backend; engine {ours}; transformers {theirs}; "
                      f"equal {ours == theirs}", flush=True)
                if ours != theirs:
                    failures.append(name)
            except Exception as error:  # noqa: BLE001  (report every run, then go on)
                failures.append(name)
                print(f"FAILED {name}: {type(error).__name__}: {error}", flush=True)
            gc.collect()  # the next engine sizes its pool from the memory this one gives back
    if failures:
        raise SystemExit(f"runs that failed or differ: {failures}")
    print("every run's tokens equal transformers'")


if __name__ == "__main__":
    main()
