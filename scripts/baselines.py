"""Other engines to measure jaxserve against, for the bench scripts only (the jaxserve package never
imports this): vLLM's CPU build in its own virtualenv, fed the embedded model as a safetensors directory.

- `embedded_hf_dir()`: the embedded Q4_1 GGUF dequantized once by transformers (float32) and written as a
  Hugging Face safetensors directory under ~/.cache/jaxserve-baselines/ (reused when present), which
  vLLM (and `scripts/bench_load.py`) can load.
- `vllm_python()`, `vllm_bin()`, `vllm_env()`: the vLLM virtualenv made by
  shared/tools/install_vllm_cpu.sh (default ~/.cache/jaxserve-baselines/vllm-cpu, or $JAXSERVE_VLLM_VENV)
  and the environment its CPU backend needs on a small machine.
- `run_vllm_offline()`: one offline vLLM measurement in a fresh process of the vLLM virtualenv, which runs
  this file as its worker (`python scripts/baselines.py vllm-offline ...`): so this module imports only
  the standard library at the top, the rest inside the functions that need it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINES_DIR = Path(os.environ.get("JAXSERVE_BASELINES_DIR", "~/.cache/jaxserve-baselines")).expanduser()
VLLM_VENV = Path(os.environ.get("JAXSERVE_VLLM_VENV", BASELINES_DIR / "vllm-cpu")).expanduser()
INSTALL_VLLM = Path(__file__).resolve().parents[2] / "shared" / "tools" / "install_vllm_cpu.sh"
VLLM_OMP_BIND = "auto"  # VLLM_CPU_OMP_THREADS_BIND
VLLM_RESERVED_CPUS: int | None = None  # VLLM_CPU_NUM_OF_RESERVED_CPU (None: vLLM's own choice)
EMBEDDED_HF_NAME = "SmolLM2-135M-Instruct-Q4_1-dequantized-f32"  # bump the name if the conversion changes


def embedded_hf_dir() -> Path:
    """The embedded GGUF as a float32 safetensors directory, converted on first use and cached."""
    out = BASELINES_DIR / EMBEDDED_HF_NAME
    if (out / "config.json").is_file():  # written last: a complete directory
        return out
    from jaxserve.weights import embedded_model_path

    BASELINES_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_HF_NAME}-", dir=BASELINES_DIR))
    gguf_to_hf_dir(embedded_model_path(), tmp)
    tmp.chmod(0o755)  # mkdtemp's is 0700
    try:
        tmp.rename(out)
    except OSError:  # another process got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_to_hf_dir(gguf: Path, out: Path) -> Path:
    """A GGUF file dequantized by transformers into `out` as a float32 Hugging Face directory.

    transformers refuses `save_pretrained` for GGUF-loaded models, so the state dict goes through
    safetensors directly (a tied lm_head is left out: loaders tie it to the embeddings again) and the
    config is saved without its `quantization_config`, which would send loaders back to the GGUF."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with model.embed_tokens
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # last: marks it done
    return out


def vllm_python() -> Path:
    """The vLLM virtualenv's python; a clear error naming the install script when it is missing."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"vLLM's CPU build is not installed at {VLLM_VENV}; run: bash {INSTALL_VLLM}")
    return python


def vllm_bin() -> Path:
    """The `vllm` command of the vLLM virtualenv (`vllm bench serve`, ...)."""
    return vllm_python().parent / "vllm"


def vllm_env(kv_cache_gib: int = 4, omp_threads_bind: str = VLLM_OMP_BIND,
             reserved_cpus: int | None = VLLM_RESERVED_CPUS) -> dict:
    """The environment for a vLLM CPU process.

    VLLM_CPU_KVCACHE_SPACE is the KV cache size in GiB. VLLM_CPU_OMP_THREADS_BIND is the cores its OpenMP
    threads are pinned to ("0-1", "auto" or "nobind"); with "auto" vLLM keeps one core per worker for its
    scheduler process, which on a 2-core machine leaves one core for the model.
    VLLM_CPU_NUM_OF_RESERVED_CPU overrides how many cores "auto" keeps back."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind,
                "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    if reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # jaxserve's, not for the vLLM virtualenv
        env.pop(name, None)
    return env


def run_vllm_offline(requests: list[tuple[list[int], int]], *, dtype: str, max_model_len: int = 2048,
                     env: dict | None = None, model: Path | None = None,
                     enable_prefix_caching: bool | None = None) -> dict:
    """Times vLLM's `LLM.generate` on `requests` ((prompt token ids, output length) pairs, greedy,
    exactly that many tokens each) in a fresh process of the vLLM virtualenv; start-up is not counted.
    Returns {"engine", "seconds", "output_tokens", "requests", "startup_s"}.

    `enable_prefix_caching` True or False is passed to `vllm.LLM(...)` as is (None: vLLM's own default, which
    differs between versions on CPU); then the engine's name says which, and the result also has
    "prompt_tokens" and "cached_tokens" (the sum of the outputs' `num_cached_tokens`)."""
    with tempfile.TemporaryDirectory(prefix="vllm_offline_") as tmp:
        requests_file, result_file = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        requests_file.write_text(json.dumps(requests))
        cmd = [str(vllm_python()), str(Path(__file__).resolve()), "vllm-offline", "--model",
               str(model or embedded_hf_dir()), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--requests", str(requests_file), "--result-json", str(result_file)]
        if enable_prefix_caching is not None:
            cmd += ["--enable-prefix-caching", "true" if enable_prefix_caching else "false"]
        subprocess.run(cmd, env=env or vllm_env(), check=True, cwd=tmp)
        return json.loads(result_file.read_text())


def vllm_offline_worker(argv: list[str]) -> None:
    """Runs inside the vLLM virtualenv: no jaxserve, no numpy needed."""
    import argparse

    parser = argparse.ArgumentParser(prog="baselines.py vllm-offline")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--result-json", type=Path, required=True)
    parser.add_argument("--enable-prefix-caching", choices=("true", "false"), default=None,
                        help="passed to vllm.LLM as given (default: left to vLLM)")
    args = parser.parse_args(argv)
    requests = json.loads(args.requests.read_text())

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    caching = {}  # vLLM's own default unless asked
    if args.enable_prefix_caching is not None:
        caching["enable_prefix_caching"] = args.enable_prefix_caching == "true"
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0, **caching)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    counts = [len(out.outputs[0].token_ids) for out in outputs]
    wrong = [(i, got, n) for i, (got, (_, n)) in enumerate(zip(counts, requests, strict=True)) if got != n]
    assert not wrong, f"vLLM produced the wrong number of tokens (request, got, asked): {wrong[:5]}"
    result = {"engine": f"vllm {args.dtype}", "seconds": elapsed, "output_tokens": sum(counts),
              "requests": len(outputs), "startup_s": startup}
    if caching:
        result["engine"] += " prefix caching " + ("on" if caching["enable_prefix_caching"] else "off")
        result["prompt_tokens"] = sum(len(prompt) for prompt, _ in requests)
        result["cached_tokens"] = sum(out.num_cached_tokens or 0 for out in outputs)
    args.result_json.write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] != ["vllm-offline"]:
        sys.exit("usage: python scripts/baselines.py vllm-offline ... (run by run_vllm_offline)")
    vllm_offline_worker(sys.argv[2:])
