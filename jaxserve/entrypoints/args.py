"""Command-line flags: one flag per EngineConfig field (`--max-model-len` -> `max_model_len`), plus the
HTTP server's own. Shared by `jaxserve generate`, `jaxserve serve` and `python -m
jaxserve.entrypoints.api_server`.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxserve.config.engine_config import DTYPE_CHOICES, SCHEDULING_POLICIES, EngineConfig
from jaxserve.config.quantization_config import KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES
from jaxserve.entrypoints.chat_output import ChatParserOptions
from jaxserve.entrypoints.reasoning_parsers import REASONING_PARSERS
from jaxserve.entrypoints.tool_parsers import TOOL_PARSERS

# The server's latency target (ms; `LLM` has none): the load sweep of docs/benchmarks/serving-load.md measured
# 400 ms ahead of vLLM's P99 ITL at every rate and of its TTFT and throughput from light load to saturation.
SERVER_MAX_ITL_MS = 400.0

# EngineConfig field -> (type, help); `model` is the positional MODEL of `serve` and `--model` elsewhere.
ENGINE_FLAGS: dict[str, tuple[type, str]] = {
    "dtype": (str, "weights and KV cache dtype; auto: bfloat16 (f32 accumulation) where the device has a bf16 "
              "matrix unit (AMX/AVX512-BF16 CPUs, TPU, sm80+ GPUs), else float32"),
    "max_model_len": (int, "longest prompt + output (default: the model's, up to the largest context bucket)"),
    "max_num_seqs": (int, "most sequences per decode step (default: the largest decode bucket)"),
    "max_num_batched_tokens": (
        int, "most tokens per step (default: the largest prefill bucket; mixed steps also stay within the largest "
        "mixed bucket)",
    ),
    "max_itl_ms": (float, "inter-token latency target in ms ('none': no target): a step with decode rows takes "
                   "the prefill chunk that lets the waiting prompts through in one step (two where cheaper), "
                   "within the largest mixed bucket whose cost (learned from the steps served) stays under the target, "
                   "past it for a backlog. Default: "
                   f"{SERVER_MAX_ITL_MS:g} for the server and precompile, none offline (mixed steps up to the bucket "
                   "file's [mixed] token_budget, and no larger mixed buckets compiled)"),
    "block_size": (int, "tokens per KV cache block (default: the bucket file's)"),
    "num_kv_blocks": (int, "KV cache blocks (default: from the memory budget; on CPU the bytes of 2048 blocks of "
                      "every layer)"),
    "kv_cache_memory_bytes": (int, "the KV cache's bytes per device instead of the memory budget's share (vLLM's): "
                              "an integer or with a suffix, k/m/g/t for powers of 1000 and K/M/G/T of 1024 "
                              "(e.g. 4G); not with --num-kv-blocks"),
    "gpu_memory_utilization": (float, "fraction of accelerator memory for weights and KV cache"),
    "disable_hybrid_kv_cache_manager": (bool, "keep every token of every layer, sliding-window layers too, in one "
                                        "KV cache group (vLLM's); by default sliding-window layers keep only "
                                        "their window"),
    "buckets": (str, "bucket file path or name (cpu, gpu, tpu; default: the platform's)"),
    "seed": (int, "seed of requests that give none"),
    "attention_backend": (str, "auto, reference, pallas or cpu"),
    "waiting_served_ratio": (float, "prefill new requests once waiting >= this ratio x decoding (TGI's; default 0)"),
    "scheduling_policy": (str, "fcfs: requests in arrival order; priority: by their `priority` (lower first), "
                          "then arrival; running requests of the lowest priority are preempted first (vLLM's)"),
    "async_scheduling": (bool, "plan step N+1 while step N runs (--no-async-scheduling reads every step first). "
                         "Default: on for TPU and GPU, off on CPU, where the host's work takes the cores the step "
                         "runs on and a request arriving mid-step would wait one step more (as vLLM's CPU backend)"),
    "max_logprobs": (int, "the most logprobs or prompt_logprobs a request may ask for"),
    "tensor_parallel_size": (int, "devices (of all hosts) that hold one engine, split by attention heads"),
    "data_parallel_size": (int, "engine replicas on this host behind the one API server, each on its own "
                           "tensor_parallel_size devices (vLLM's internal load balancing: a request goes to the "
                           "replica holding the fewest unfinished requests)"),
    "data_parallel_rank": (int, "which replica this engine is: it runs on devices [rank x tensor_parallel_size, "
                           "(rank + 1) x tensor_parallel_size) and publishes its KV cache events on the endpoint's "
                           "port + rank (set by --data-parallel-size for each replica)"),
    "distributed_init": (bool, "join a multi-host run: jax.distributed.initialize (or JAXSERVE_DISTRIBUTED_INIT=1)"),
    "coordinator_address": (str, "host:port of process 0 (or JAXSERVE_COORDINATOR_ADDRESS; auto on TPU pods)"),
    "num_processes": (int, "or JAXSERVE_NUM_PROCESSES"),
    "process_id": (int, "or JAXSERVE_PROCESS_ID"),
    "compile_cache_dir": (str, "JAX persistent compilation cache: warm-up loads executables from it and stores "
                          "new ones (`jaxserve precompile` fills it). Default: $JAXSERVE_COMPILE_CACHE_DIR if "
                          "set, else ~/.cache/jaxserve/compile_cache (under $XDG_CACHE_HOME if set); "
                          "'' (or JAXSERVE_COMPILE_CACHE_DIR='') disables it"),
    "strict_no_compile": (bool, "fail if anything compiles on the step path after warm-up"),
    "background_compile": (bool, "serve once the covering set of buckets is built (every step has a bucket that "
                           "holds it, padded) and build the others in a thread, each used from the step after it "
                           "lands (the server's default; --no-background-compile builds the whole grid first)"),
    "enable_prefix_caching": (bool, "reuse the KV blocks of prompt prefixes computed before (on by default, as "
                              "vLLM's; --no-enable-prefix-caching computes every prompt whole)"),
    "disable_log_stats": (bool, "no periodic stats line (throughput, queues, KV usage, prefix cache hit rate)"),
    "speculative_config": (str, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                           "or a draft model: '{\"model\": PATH, \"num_speculative_tokens\": 4}' or suffix "
                           "decoding: '{\"method\": \"suffix\"}' (also \"disable_by_batch_size\": no drafts while "
                           "more sequences decode; default 8)"),
    "kv_events_config": (str, "publish the prefix cache's stored and evicted blocks for KV-aware routers, vLLM's "
                         "JSON: '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}' (ZeroMQ, "
                         "vLLM's event format; vllm-router --policy kv_aware reads it)"),
    "structured_outputs_config": (str, "how structured outputs are enforced, vLLM's JSON: "
                                  "'{\"disable_additional_properties\": false}' lets JSON schemas' objects hold "
                                  "properties they do not name (default true: strict, as vLLM's default backend); "
                                  "'{\"enable_in_reasoning\": true}' constrains the reasoning too (default: under "
                                  "--reasoning-parser a constraint applies once the reasoning has ended)"),
    "quantization": (str, "quantize the weights at load: int8 (int8 weights, W8A16), int8_w8a8 (int8 weights and "
                     "activations), fp8 (float8 e4m3 weights; float8 activations too on GPUs of compute capability "
                     "8.9+); per output channel, activations per token"),
    "kv_cache_dtype": (str, "what the KV cache stores: auto (the model's dtype), fp8 / fp8_e4m3 (float8 e4m3, "
                       "scale 1, vLLM's: half of bfloat16's bytes, twice the tokens) or int8 / int8_per_token_head "
                       "(int8 with a float32 scale per token and kv head: 0.52-0.53 of bfloat16's bytes)"),
}
FLAG_ALIASES = {"tensor_parallel_size": ["-tp"], "data_parallel_size": ["-dp"]}  # vLLM's


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="HF directory, .gguf file, orbax checkpoint dir or hub id (default: the embedded "
                            "SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None,
                        help="HF directory, .gguf file, orbax checkpoint dir or hub id (default: embedded)")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        kwargs: dict = {"default": defaults[name], "help": help_text}
        if kind is bool:  # --flag / --no-flag
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name == "max_itl_ms":
            kwargs["type"] = _milliseconds_or_none
        elif name == "kv_cache_memory_bytes":
            kwargs["type"] = human_readable_int
        else:
            kwargs["type"] = kind
        if name == "dtype":
            kwargs["choices"] = list(DTYPE_CHOICES)
        elif name == "quantization":
            kwargs["choices"] = list(QUANTIZATION_CHOICES)
        elif name == "kv_cache_dtype":
            kwargs["choices"] = list(KV_CACHE_DTYPE_CHOICES)
        elif name == "scheduling_policy":
            kwargs["choices"] = list(SCHEDULING_POLICIES)
        elif name == "attention_backend":
            kwargs["choices"] = ["auto", "reference", "pallas", "cpu"]
        parser.add_argument("--" + name.replace("_", "-"), *FLAG_ALIASES.get(name, []), **kwargs)


# vLLM's suffixes of human-readable integers: lowercase decimal, uppercase binary
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An integer, or a number with a suffix: "1.5g" = 1,500,000,000, "4G" = 4 * 2**30 (vLLM's rule)."""
    text = text.strip()
    scale = _DECIMAL_SUFFIXES.get(text[-1:]) or _BINARY_SUFFIXES.get(text[-1:])
    try:
        if scale is None:
            return int(text)
        return int(float(text[:-1]) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, optionally with a suffix k/m/g/t (powers of 1000) or K/M/G/T (of 1024), got "
            f"{text!r}") from None


def _milliseconds_or_none(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'none', got {text!r}") from None


ENGINE_CORE_PROCESS = False  # the server's default; see docs/benchmarks/serving-load.md


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(max_itl_ms=SERVER_MAX_ITL_MS)  # a server has a latency target; offline runs do not
    parser.set_defaults(background_compile=True)  # a server answers before its whole grid is built
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default, as vLLM: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` (default: the JAXSERVE_API_KEY variable, if set)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: MODEL, or SmolLM2-135M-Instruct)")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template for chat requests that name none: a Jinja file, or the template "
                        "itself (default: the tokenizer's; needed for models without one, e.g. many GGUF files)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let a chat or tokenize request bring its own chat template (`chat_template`, or in "
                        "`chat_template_kwargs`): Jinja the server runs, so refused by default (vLLM's flag)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice \"auto\": parse the model's own tool calls (needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                        help="the model's tool call format, read under tool_choice \"auto\" (vLLM's names)")
    parser.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="split <think> reasoning into reasoning_content (deepseek_r1, qwen3)")
    parser.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=ENGINE_CORE_PROCESS,
                        help="run the scheduler and the device steps in a process of their own, the HTTP server, "
                        "tokenization and streaming in this one (vLLM V1's split)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def chat_parser_options_from_args(args: argparse.Namespace) -> ChatParserOptions:
    return ChatParserOptions(enable_auto_tool_choice=args.enable_auto_tool_choice,
                             tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)


def model_from_args(args: argparse.Namespace) -> str | None:
    return getattr(args, "model_tag", None) or args.model


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags; a flag whose parsed value is None (a command's "decide later"
    default, e.g. precompile's tensor parallel size) takes EngineConfig's default."""
    values = {name: getattr(args, name) for name in ENGINE_FLAGS}
    kept = {k: v for k, v in values.items() if v is not None or k == "max_itl_ms"}  # max_itl_ms None: no target
    return EngineConfig(model=model_from_args(args), **kept)
