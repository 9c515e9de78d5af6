"""The `jaxserve` command: `jaxserve generate "prompt"` prints a greedy completion; `jaxserve precompile`
compiles every bucket into the persistent compilation cache (`scripts/precompile.py` runs the same).

With no `--model` it runs the embedded SmolLM2-135M-Instruct; a chat model's template is applied
unless `--no-chat-template` is given.
"""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF directory, .gguf file, orbax checkpoint dir or hub id (default: embedded)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--buckets", default=None, help="bucket file path or name (cpu, gpu, tpu)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="devices (of all hosts) that hold one engine, split by attention heads")
    parser.add_argument("--distributed-init", action="store_true",
                        help="join a multi-host run with jax.distributed.initialize (or JAXSERVE_DISTRIBUTED_INIT=1)")
    parser.add_argument("--coordinator-address", default=None,
                        help="host:port of process 0 (or JAXSERVE_COORDINATOR_ADDRESS; auto-detected on TPU pods)")
    parser.add_argument("--num-processes", type=int, default=None, help="or JAXSERVE_NUM_PROCESSES")
    parser.add_argument("--process-id", type=int, default=None, help="or JAXSERVE_PROCESS_ID")
    parser.add_argument(
        "--compile-cache-dir", default=None,
        help="JAX persistent compilation cache: warm-up loads executables from it and stores new ones",
    )
    parser.add_argument(
        "--strict-no-compile", action="store_true", help="fail if anything compiles after warm-up"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving engine in JAX/XLA")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="print a greedy completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    _add_engine_args(gen)
    gen.set_defaults(max_model_len=2048)  # one prompt: a smaller bucket grid warms up faster
    pre = commands.add_parser(
        "precompile", help="compile every bucket into the persistent compilation cache",
        description="Compiles every feasible bucket of the engine configuration given by the engine flags "
        "into --compile-cache-dir (default ~/.cache/jaxserve/compile_cache, under $XDG_CACHE_HOME if set) "
        "and records a manifest there. Start the engine with the same flags and --compile-cache-dir.",
    )
    _add_engine_args(pre)
    pre.add_argument(
        "--num-threads", type=int, default=None, help="buckets compiled at once (default: measured best, 1)"
    )
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _engine_kwargs(args: argparse.Namespace) -> dict:
    names = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
             "gpu_memory_utilization", "buckets", "attention_backend", "seed", "tensor_parallel_size",
             "distributed_init", "coordinator_address", "num_processes", "process_id", "compile_cache_dir",
             "strict_no_compile")
    return {name: getattr(args, name) for name in names}


def run_precompile(args: argparse.Namespace) -> int:
    from jaxserve.config import EngineConfig
    from jaxserve.precompile import precompile
    from jaxserve.warm_up import DEFAULT_COMPILE_THREADS

    config = EngineConfig(model=args.model, **_engine_kwargs(args))
    print(f"precompiling {args.model or 'the embedded model'} ({args.dtype})", flush=True)
    result = precompile(
        config, num_threads=args.num_threads or DEFAULT_COMPILE_THREADS, progress=not args.no_progress
    )
    print(result.describe())
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    prompt = args.prompt
    if not args.no_chat_template and getattr(tokenizer, "chat_template", None):
        prompt = {"prompt_token_ids": chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the assistant turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "precompile":
        return run_precompile(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
