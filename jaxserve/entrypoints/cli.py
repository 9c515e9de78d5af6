"""The `jaxserve` command.

- `jaxserve serve [MODEL]` starts the OpenAI-compatible HTTP server (`api_server.py`); with no MODEL it
  serves the embedded SmolLM2-135M-Instruct.
- `jaxserve generate "prompt"` prints a greedy completion; a chat model's template is applied unless
  `--no-chat-template` is given.
- `jaxserve precompile` compiles every bucket into the persistent compilation cache
  (`scripts/precompile.py` runs the same); start the engine with the same flags (and `--compile-cache-dir`,
  unless both use the default directory). With `--target` it builds for a TPU topology or CUDA, listing its
  programs first (`--list`: only that).

Engine flags map one to one onto EngineConfig fields (`args.py`).
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.entrypoints.args import (
    ENGINE_FLAGS,
    SERVER_MAX_ITL_MS,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    model_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving engine in JAX/XLA")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_engine_args(serve, model_positional=True)
    add_server_args(serve)
    gen = commands.add_parser("generate", help="print a greedy completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    add_engine_args(gen)
    gen.set_defaults(max_model_len=2048)  # one prompt: a smaller bucket grid warms up faster
    pre = commands.add_parser(
        "precompile", help="compile every bucket into the persistent compilation cache",
        description="Compiles every feasible bucket of the engine configuration given by the engine flags "
        "into --compile-cache-dir (default $JAXSERVE_COMPILE_CACHE_DIR, else ~/.cache/jaxserve/compile_cache, "
        "under $XDG_CACHE_HOME if set) and records a manifest there. Start the engine with the same flags: it "
        "uses the same default directory.",
    )
    add_engine_args(pre)
    pre.add_argument(
        "--num-threads", type=int, default=None, help="buckets compiled at once (default: measured best, 1)"
    )
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.add_argument(
        "--target", default=None, metavar="TOPOLOGY",
        help="compile for hardware this host does not have: a TPU topology in JAX's names (v5e:2x2, v6e:2x2, "
        "v5p:2x2x1, ...; needs jaxserve[tpu]) compiled deviceless with the Pallas kernels, tensor parallel over as "
        "many of its chips as the model's heads divide (or --tensor-parallel-size), KV pool sized from the "
        "chips' HBM; or 'cuda' with --lower-only. Prints memory per program and exits 1 if any fails or does "
        "not fit",
    )
    pre.add_argument("--lower-only", action="store_true", help="with --target cuda: lower every program, no compile")
    pre.add_argument(
        "--list", action="store_true",
        help="with --target: list the programs it would build (name and kind a line, the total and a count per "
        "kind) and compile nothing (the KV pool is the memory budget's, before the largest steps give blocks back)",
    )
    pre.set_defaults(tensor_parallel_size=None)  # with --target: None picks it from the topology
    # caches are precompiled for servers: with the server's latency target the grid holds its larger mixed steps
    pre.set_defaults(max_itl_ms=SERVER_MAX_ITL_MS)
    return parser


def run_precompile(args: argparse.Namespace) -> int:
    from jaxserve.compilation.precompile import precompile
    from jaxserve.compilation.warm_up import DEFAULT_COMPILE_THREADS

    if args.target is not None or args.lower_only or args.list:
        return run_target_precompile(args)
    config = engine_config_from_args(args)
    print(f"precompiling {config.model or 'the embedded model'} ({config.dtype})", flush=True)
    result = precompile(
        config, num_threads=args.num_threads or DEFAULT_COMPILE_THREADS, progress=not args.no_progress
    )
    print(result.describe())
    return 0


def run_target_precompile(args: argparse.Namespace) -> int:
    from jaxserve.compilation.target_compile import compile_plan, plan_for_target

    if args.target is None:
        raise SystemExit(f"jaxserve precompile: {'--list' if args.list else '--lower-only'} needs --target")
    if (args.target == "cuda") != args.lower_only and not args.list:
        raise SystemExit("jaxserve precompile: compiling for CUDA needs a GPU: use --target cuda --lower-only "
                         "(--lower-only applies to cuda only)")
    config = engine_config_from_args(args)  # tensor parallel: the target's mesh (below) decides
    print(f"building {config.model or 'the embedded model'} for {args.target}", flush=True)
    plan = plan_for_target(config, args.target, tensor_parallel_size=args.tensor_parallel_size,
                           fit_to_steps=not args.list)
    print(plan.format_programs(), flush=True)
    if args.list:
        print("compiled nothing: the KV pool (zeros-*) is the memory budget's; compiling fits it to the largest "
              "steps, which gives some blocks back")
        return 0
    report = compile_plan(plan)
    print(report.format_table())
    if report.cache_dir is not None and not report.failures():
        print(f"executables and manifest in {report.cache_dir}; on the target start the engine with the same flags, "
              f"--tensor-parallel-size {report.tensor_parallel_size}, --num-kv-blocks {report.grid.num_blocks} (a "
              "different pool is a different program: it would compile) and --compile-cache-dir pointing at a copy")
    return 1 if report.failures() else 0


def run_generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model_from_args(args), **{name: getattr(args, name) for name in ENGINE_FLAGS})
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
    if args.command == "serve":
        from jaxserve.entrypoints.api_server import run_server

        return run_server(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "precompile":
        return run_precompile(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
