"""The draft-model proposer at its bounds: the target drafting for itself (acceptance near 1, the draft costing
as much as the target) and a tiny random draft of the target's vocabulary (acceptance near 0, drafting nearly
free), against no speculation, in one process (offline `LLM` engines on the same model and grid).

Greedy, exactly `--output-len` tokens per request (`ignore_eos`), prompts of `--prompt-len` random token ids, at
each concurrency (`--concurrencies`: that many requests at once). Reports output tokens per second and target
steps for each, the share of drafts accepted, the draft model's steps and seconds (`DraftModelProposer`'s
counters: its catch-up and decode steps, timed with the tokens read back), and what a rejected draft costs: the
random draft's extra time per target step over a decode step of no speculation, per draft, split into its
drafting (the draft model's seconds per draft) and its verification (the rest), both as a share of a decode step.

    python scripts/bench_draft_model.py                       # the embedded SmolLM2 (bfloat16 on this CPU)
    python scripts/bench_draft_model.py --dtype float32       # no near-tie flips: self-drafting accepts all
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_draft_bounds import prompts_of, timed_generate  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.testing.tiny_models import byte_level_tokenizer  # noqa: E402
from jaxserve.weights import resolve_model_path  # noqa: E402

ENGINES = ("off", "self", "random")


def random_draft(path: Path, vocab_size: int) -> Path:
    """A random two-layer Llama (hidden 128) of the target's vocabulary, saved as a Hugging Face directory."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def build_engine(name: str, args, tmp: Path) -> LLM:
    """The engine ``name`` of ENGINES: no speculation, the target drafting for itself, or the random draft."""
    target = resolve_model_path(args.model)
    common = {"dtype": args.dtype, "max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks,
              "enable_prefix_caching": False}
    if name == "off":
        return LLM(str(target), **common)
    draft = target if name == "self" else random_draft(tmp / "random-draft", args.vocab_size)
    return LLM(str(target), **common, speculative_config={
        "model": str(draft), "num_speculative_tokens": args.num_speculative_tokens})


def measure_engine(name: str, args) -> list[dict]:
    """One engine's run at each concurrency: its outputs, seconds, target steps, drafts and draft-model work."""
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_engine(name, args, Path(tmp))
        engine = llm.llm_engine
        timed_generate(llm, prompts_of(2, args.prompt_len, args.vocab_size, seed=1), SamplingParams(max_tokens=8))
        results = []
        for concurrency in map(int, args.concurrencies.split(",")):
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
            prompts = prompts_of(concurrency, args.prompt_len, args.vocab_size, seed=1000 * concurrency)
            stats, proposer = engine.stats, engine.proposer
            before = _counters(stats, proposer)
            tokens, seconds, steps = timed_generate(llm, prompts, params)
            drafted, accepted, draft_steps, draft_s = (b - a for a, b in zip(before, _counters(stats, proposer),
                                                                                strict=True))
            results.append({"outputs": tokens, "s": seconds, "steps": steps, "tok_s": concurrency * args.output_len
                            / seconds, "drafted": drafted, "accepted": accepted, "draft_steps": draft_steps,
                            "draft_s": draft_s})
        return results


def _counters(stats, proposer) -> tuple:
    draft = (proposer.num_steps, proposer.fill_seconds) if proposer is not None else (0, 0.0)
    return (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens, *draft)


def run_engines(args) -> list[dict]:
    """Each engine in its own process, one after the other (three engines and a draft's executables do not fit one
    process's memory maps on this CPU); the rows by concurrency."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ENGINES:
            out = Path(tmp) / f"{name}.json"
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--engine", name, "--engine-json", str(out)],
                           check=True)
            runs[name] = json.loads(out.read_text())
    rows = []
    for i, concurrency in enumerate(map(int, args.concurrencies.split(","))):
        row = {"concurrency": concurrency, **{name: dict(runs[name][i]) for name in ENGINES}}
        for name in ENGINES:
            row[name]["same_outputs"] = sum(a == b for a, b in zip(row[name].pop("outputs"),
                                                                    runs["off"][i]["outputs"], strict=True))
        rows.append(_with_costs(row))
    return rows


def _with_costs(row: dict) -> dict:
    """The cost of a rejected draft from the random draft's run, as a share of a decode step without speculation."""
    off, rand = row["off"], row["random"]
    decode_step = off["s"] / off["steps"]
    extra = rand["s"] / rand["steps"] - decode_step
    row["rejected_draft_cost"] = extra / (rand["drafted"] / rand["steps"]) / decode_step
    row["rejected_draft_drafting"] = rand["draft_s"] / max(rand["drafted"], 1) / decode_step
    row["rejected_draft_verifying"] = row["rejected_draft_cost"] - row["rejected_draft_drafting"]
    return row


def print_table(rows: list[dict]) -> None:
    print("| concurrency | off tok/s | self-draft tok/s (vs off) | accepted | random draft tok/s (vs off) | accepted | "
          "target steps off / self / random | draft steps self / random | draft s self / random | a rejected draft "
          "costs (drafting + verifying), of a decode step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        off, me, rand = r["off"], r["self"], r["random"]
        print(f"| {r['concurrency']} | {off['tok_s']:.1f} | {me['tok_s']:.1f} ({me['tok_s'] / off['tok_s']:.2f}x) | "
              f"{me['accepted'] / max(me['drafted'], 1):.0%} | {rand['tok_s']:.1f} "
              f"({rand['tok_s'] / off['tok_s']:.2f}x) | {rand['accepted'] / max(rand['drafted'], 1):.0%} | "
              f"{off['steps']} / {me['steps']} / {rand['steps']} | {me['draft_steps']} / {rand['draft_steps']} | "
              f"{me['draft_s']:.1f} / {rand['draft_s']:.1f} | {r['rejected_draft_cost']:.2f} "
              f"({r['rejected_draft_drafting']:.2f} + {r['rejected_draft_verifying']:.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--vocab-size", type=int, default=49152, help="the target's (SmolLM2's): the random draft's")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrencies", default="1,4")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # a child process: one engine
    parser.add_argument("--engine-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        Path(args.engine_json).write_text(json.dumps(measure_engine(args.engine, args)))
        return
    rows = run_engines(args)
    print_table(rows)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
