"""Grammar engines for structured outputs (constrained decoding), measured on the model's tokenizer.

For each installed engine (llguidance, xgrammar) this reports, as markdown tables:

* package facts: version, wheel size, installed size, declared requirements, and what `import <engine>`
  costs and pulls in, measured in a fresh interpreter (torch? triton? transformers?);
* tokenizer setup: building the engine's tokenizer/vocabulary info from the HF tokenizer;
* grammar compile time for a nested JSON schema, `json_object` (any JSON object), a regex (ISO date),
  a choice list and a small context-free grammar (Lark for llguidance, EBNF for xgrammar), plus the
  cost of a new per-request matcher from the compiled grammar and of its first mask;
* mask time per token: a valid instance of each grammar, tokenized by the HF tokenizer, is walked
  token by token; every step times filling the packed int32 bitmask row (`(vocab + 31) // 32` words,
  bit `t & 31` of word `t >> 5` = token t allowed) for the full vocabulary, then advances the matcher.
  The first walk runs on the matcher made at compile time ("cold": llguidance builds its lexer states
  lazily); the following `--walks - 1` walks each run on a new per-request matcher ("warm");
* correctness: at every step the next token of the instance must be allowed and EOS must not be
  (the instances are chosen so that no proper prefix is complete); at the end EOS must be allowed,
  accepted, and leave the matcher stopped.

    python scripts/bench_grammar_engines.py                       # both engines, embedded SmolLM2-135M
    python scripts/bench_grammar_engines.py --engines llguidance --walks 10
    python scripts/bench_grammar_engines.py --model path/to/hf_dir --wheels /tmp/wheels
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["engineer", "manager", "designer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "email": {"type": "string"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
SCHEMA_INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "engineer",
    "address": {"street": "12 St James's Square", "city": "London"},
    "tags": ["math", "poetry", "analytical engines"],
}
OBJECT_INSTANCE = {"id": 7, "ok": True, "items": [1, 2.5, None, "x"], "meta": {"note": "any object", "n": -3e2}}
DATE_REGEX = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["positive", "negative", "neutral"]
LARK = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EBNF = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
# name -> valid instance; no proper prefix of an instance is itself complete, so EOS must stay masked until the end
INSTANCES = {
    "json_schema": json.dumps(SCHEMA_INSTANCE),
    "json_object": json.dumps(OBJECT_INSTANCE),
    "regex": "2024-03-15",
    "choice": "neutral",
    "cfg": "((12+3)*4-5/(6+78))",
}
CFG_LABEL = {"llguidance": "lark", "xgrammar": "ebnf"}


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.llg_np = llguidance, llguidance.numpy
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)  # np.int32 (1, ceil(V/32))
        self.bits = self.bitmask[0]

    def grammar(self, kind: str) -> str:
        matcher = self.llg.LLMatcher
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(SCHEMA)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return matcher.grammar_from_regex(DATE_REGEX)
        if kind == "choice":
            return self.llg.grammar_from("choice", json.dumps(CHOICES))
        return matcher.grammar_from_lark(LARK)

    def compile(self, kind: str):
        """The grammar is compiled when the matcher is built; errors land in is_error(), never raise."""
        m = self.llg.LLMatcher(self.tokenizer, self.grammar(kind), log_level=1)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def first_matcher(self, compiled):
        return compiled.deep_copy()

    def new_matcher(self, compiled):
        return compiled.deep_copy()  # per-request copy of the pristine matcher: no recompile

    def fill(self, m) -> None:
        self.llg_np.fill_next_token_bitmask(m, self.bitmask, 0)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def accepting(self, m) -> bool:
        return m.is_accepting()

    def stopped(self, m) -> bool:
        return m.is_stopped()

    def error(self, m) -> str:
        return m.get_error()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info)
        self.setup_s = time.perf_counter() - start
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # torch.int32 (1, ceil(V/32)), CPU
        self.bits = self.bitmask.numpy()[0]  # shares memory

    def compile(self, kind: str):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(SCHEMA)
        if kind == "json_object":
            # compile_json_schema({"type": "object"}) in the default strict mode only allows {}
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(DATE_REGEX)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in CHOICES))
        return c.compile_grammar(EBNF)

    def first_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask, 0)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def accepting(self, m) -> bool:
        return m.is_completed()

    def stopped(self, m) -> bool:
        return m.is_terminated()

    def error(self, m) -> str:
        return ""


ENGINES = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine}


def allowed(bits: np.ndarray, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def walk(engine, m, tokens: list[int], eos: int) -> tuple[list[float], list[float], list[str], list[int]]:
    """Mask + consume every token of a valid instance, then EOS;
    (mask µs per step, consume µs per step, problems, allowed-token count per step)."""
    mask_us, consume_us, problems, counts = [], [], [], []
    for step, token in enumerate([*tokens, eos]):
        start = time.perf_counter_ns()
        engine.fill(m)
        mask_us.append((time.perf_counter_ns() - start) / 1e3)
        counts.append(int(np.bitwise_count(engine.bits.view(np.uint32)).sum()))
        if not allowed(engine.bits, token):
            problems.append(f"step {step}: token {token} {'(EOS) ' if token == eos else ''}masked out")
        if token != eos and allowed(engine.bits, eos):
            problems.append(f"step {step}: EOS allowed before the end")
        if token == eos and not engine.accepting(m):
            problems.append("not accepting before EOS")
        start = time.perf_counter_ns()
        ok = engine.consume(m, token)
        consume_us.append((time.perf_counter_ns() - start) / 1e3)
        if not ok:
            problems.append(f"step {step}: consuming token {token} failed {engine.error(m)}".rstrip())
            break
    if not problems and not engine.stopped(m):
        problems.append("not stopped after EOS")
    return mask_us, consume_us, problems, counts


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def bench_engine(engine, tokenizer, eos: int, walks: int) -> list[dict]:
    rows = []
    for kind, text in INSTANCES.items():
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokens) == text, (kind, text)
        row = {"grammar": kind if kind != "cfg" else f"cfg ({CFG_LABEL[engine.name]})", "tokens": len(tokens)}
        try:
            start = time.perf_counter()
            compiled = engine.compile(kind)
            row["compile_ms"] = 1e3 * (time.perf_counter() - start)
        except Exception as err:  # reported in the table
            row["problems"] = [f"compile failed: {type(err).__name__}: {err}"]
            rows.append(row)
            continue
        first = engine.first_matcher(compiled)
        cold_mask, cold_consume, problems, counts = walk(engine, first, tokens, eos)
        warm_mask, warm_consume, new_matcher_us = [], [], []
        for _ in range(walks - 1):
            start = time.perf_counter_ns()
            m = engine.new_matcher(compiled)
            new_matcher_us.append((time.perf_counter_ns() - start) / 1e3)
            mask_us, consume_us, more, _ = walk(engine, m, tokens, eos)
            warm_mask += mask_us
            warm_consume += consume_us
            problems += [p for p in more if p not in problems]
        row.update(first_mask_us=cold_mask[0], cold_mean=statistics.mean(cold_mask), cold_p99=p99(cold_mask),
                   consume_mean=statistics.mean(warm_consume or cold_consume), problems=problems,
                   allowed_first=counts[0], allowed_mean=statistics.mean(counts))
        if warm_mask:
            row.update(warm_mean=statistics.mean(warm_mask), warm_p99=p99(warm_mask),
                       new_matcher_us=statistics.median(new_matcher_us))
        rows.append(row)
    return rows


IMPORT_PROBE = """
import json, sys, time
watch = ("torch", "triton", "transformers", "tvm_ffi", "numpy")
before = {m for m in watch if m in sys.modules}
start = time.perf_counter()
import {module}
elapsed = time.perf_counter() - start
print(json.dumps({"import_s": elapsed, "pulled_in": [m for m in watch if m in sys.modules and m not in before]}))
"""


def package_facts(dist: str, wheels: Path) -> dict:
    facts = {"version": importlib.metadata.version(dist)}
    files = importlib.metadata.files(dist) or []
    facts["installed_mb"] = sum(f.locate().stat().st_size for f in files if f.locate().is_file()) / 2**20
    requires = importlib.metadata.requires(dist) or []
    facts["requires"] = [r.split(";")[0].strip() + (" (Linux x86_64)" if "platform_machine" in r else "")
                         for r in requires if "extra ==" not in r]
    wheel = sorted(wheels.glob(f"{dist.replace('-', '_')}-{facts['version']}-*.whl"))
    facts["wheel_mb"] = wheel[0].stat().st_size / 2**20 if wheel else None
    code = IMPORT_PROBE.replace("{module}", dist.replace("-", "_"))
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    facts.update(json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0
                 else {"import_error": probe.stderr.strip().splitlines()[-1]})
    return facts


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir / GGUF; default: the embedded SmolLM2-135M")
    parser.add_argument("--engines", default="llguidance,xgrammar", help="comma-separated subset")
    parser.add_argument("--walks", type=int, default=10, help="walks per grammar (the first is the cold one)")
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/wheels"), help="where the wheels are, for sizes")
    args = parser.parse_args()

    from jaxserve.weights import load_config, load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    config = load_config(path)
    vocab_size, eos = config.vocab_size, config.eos_token_id[0]
    print(f"model: {path.name}, vocab {vocab_size}, EOS {eos} ({tokenizer.convert_ids_to_tokens(eos)}), "
          f"bitmask int32[1, {(vocab_size + 31) // 32}]\n")

    names = [n for n in args.engines.split(",") if n]
    facts, results, setup = {}, {}, {}
    for name in names:
        try:
            facts[name] = package_facts(name, args.wheels)
        except importlib.metadata.PackageNotFoundError:
            print(f"{name}: not installed, skipped\n")
            continue
        engine = ENGINES[name](tokenizer, vocab_size, eos)
        setup[name] = engine.setup_s
        results[name] = bench_engine(engine, tokenizer, eos, args.walks)

    print("| engine | version | wheel MB | installed MB | requires | import s (fresh process) | import pulls in |")
    print("|---|---|---|---|---|---|---|")
    for name, f in facts.items():
        print(f"| {name} | {f['version']} | {fmt(f['wheel_mb'])} | {f['installed_mb']:.1f} | "
              f"{', '.join(f['requires']) or 'none'} | {fmt(f.get('import_s'), '.2f')} | "
              f"{', '.join(f.get('pulled_in', [])) or f.get('import_error', 'nothing watched')} |")

    print("\n| engine | tokenizer setup ms |\n|---|---|")
    for name, seconds in setup.items():
        print(f"| {name} | {1e3 * seconds:.0f} |")

    print(f"\n| grammar | engine | compile ms | new matcher µs | first mask µs | tokens | cold mask mean/p99 µs | "
          f"warm mask mean/p99 µs ({args.walks - 1} walks) | consume mean µs | allowed tokens step 0 / mean | "
          "correct |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in INSTANCES:
        for name, rows in results.items():
            row = next(r for r in rows if r["grammar"].split(" ")[0] == kind)
            problems = row.get("problems", [])
            if "compile_ms" not in row:
                print(f"| {row['grammar']} | {name} | failed | | | {row['tokens']} | | | | | {problems[0]} |")
                continue
            print(f"| {row['grammar']} | {name} | {row['compile_ms']:.1f} | {fmt(row.get('new_matcher_us'))} | "
                  f"{row['first_mask_us']:.0f} | {row['tokens']} | {row['cold_mean']:.0f} / {row['cold_p99']:.0f} | "
                  f"{fmt(row.get('warm_mean'), '.0f')} / {fmt(row.get('warm_p99'), '.0f')} | "
                  f"{row['consume_mean']:.1f} | {row['allowed_first']} / {row['allowed_mean']:.0f} | "
                  f"{'yes' if not problems else 'NO: ' + '; '.join(problems[:3])} |")


if __name__ == "__main__":
    main()
