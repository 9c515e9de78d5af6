"""Compile every bucket of the default TPU grid for TPU topologies, and lower the GPU grid for CUDA, on this host.

The checks `jaxserve precompile --target` runs, over the configurations docs/benchmarks/targets.md reports: the
embedded SmolLM2-135M, a Llama-3-8B-shaped, a Qwen3-30B-A3B-shaped (mixture of experts: 48 layers, 128
experts, top-8), a gpt-oss-20b-shaped and a DeepSeek-V2-Lite-shaped config (abstract weights: only its config.json
is written) on each topology, tensor parallel over as many chips as the heads divide. Prints each target's table
(compile seconds, memory per device against HBM) and exits 1 if any program fails or does not fit.

    python scripts/check_targets.py                                # v5e:2x2 and v6e:2x2, both models, and cuda
    python scripts/check_targets.py --targets v5e:2x2 --models embedded --out /tmp/tables.md
    python scripts/check_targets.py --targets v6e:2x2 --models qwen3-30b-a3b --largest-only
    python scripts/check_targets.py --targets v6e:2x2 --models gpt-oss-20b --max-model-len 8192
    python scripts/check_targets.py --targets v6e:2x2 --models deepseek-v2-lite --max-model-len 8192 --largest-only
    python scripts/check_targets.py --targets v5e:2x2 --models llama3-8b --tensor-parallel-size 1 --quantization int8
    python scripts/check_targets.py --targets v5e:2x2 --models llama3-8b --tensor-parallel-size 1 --quantization int8 \
        --kv-cache-dtype fp8                                       # and a float8 KV cache: twice the tokens
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python scripts/check_targets.py --targets cuda --models qwen3-30b-a3b --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jaxserve.compilation.target_compile import compile_for_target  # noqa: E402
from jaxserve.config.engine_config import EngineConfig  # noqa: E402
from jaxserve.config.quantization_config import KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# gpt-oss-20b's config.json (its experts served dequantized from mxfp4 to bfloat16): sinks, alternating sliding
# (128) and full layers, 32 biased experts, top-4
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "vocab_size": 201088,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "eos_token_id": 200002,
}
# DeepSeek-V2-Lite's config.json (15.7B parameters, 2.4B active): latent attention (kv_lora_rank 512, rotary 64), one
# q_proj, 64 experts top-6 with 2 shared, the first layer dense, YaRN (factor 40)
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 100000, "eos_token_id": 100001,
}
SHAPED_CONFIGS = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B,
                  "deepseek-v2-lite": DEEPSEEK_V2_LITE}


def model_path(name: str, workdir: Path) -> str | None:
    if name == "embedded":
        return None
    if name in SHAPED_CONFIGS:
        path = workdir / f"{name}-shaped"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(SHAPED_CONFIGS[name]))
        return str(path)
    return name  # a model directory or GGUF file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="v5e:2x2,v6e:2x2,cuda")
    parser.add_argument("--models", default="embedded,llama3-8b",
                        help="embedded, llama3-8b, qwen3-30b-a3b, gpt-oss-20b, deepseek-v2-lite, or model paths")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's, up to the grid's")
    parser.add_argument("--out", type=Path, default=None, help="also append the tables to this file")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of a device's HBM for weights and KV pool (default: EngineConfig's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="default: as many of a TPU topology's chips as the heads divide; cuda: 1 (set it, with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=N, for a model one GPU cannot hold)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="quantized weights (int8, int8_w8a8, fp8, gguf): e.g. Llama-3-8B in int8 on one v5e chip")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="what the KV cache stores: the model's dtype (auto) or float8 e4m3 (fp8)")
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="every layer keeps every token, sliding-window layers too (no KV cache groups)")
    parser.add_argument("--largest-only", action="store_true",
                        help="only the largest prefill, decode and mixed step of the grid (a quick worst case)")
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets.split(","):
            for model in args.models.split(","):
                limits = {} if args.gpu_memory_utilization is None else {
                    "gpu_memory_utilization": args.gpu_memory_utilization}
                config = EngineConfig(model=model_path(model, Path(tmp)), max_model_len=args.max_model_len,
                                      compile_cache_dir="", quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype,
                                      disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager, **limits)
                start = time.perf_counter()
                report = compile_for_target(config, target, largest_only=args.largest_only,
                                            tensor_parallel_size=args.tensor_parallel_size)
                seconds = time.perf_counter() - start
                scope = ", largest step of each kind" if args.largest_only else ""
                scope += f", {args.quantization} weights" if args.quantization else ""
                scope += f", {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype != "auto" else ""
                scope += ", one KV cache group" if args.disable_hybrid_kv_cache_manager else ""
                text = f"## {model} on {target}{scope} ({seconds:.0f} s)\n\n```\n{report.format_table()}\n```\n"
                print(text, flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(text + "\n")
                failed |= bool(report.failures())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
