"""The documentation's commands: every `python scripts/X.py ...` (or `bash scripts/X.sh`) command that README.md and
docs/benchmarks/*.md name, in code spans and code blocks, names a committed script whose `--help` lists every flag the
command passes; and every result on the benchmarks' front page names the command of a committed script. A figure
whose harness was never committed, or whose command no longer runs, fails here."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

DOCS = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs" / "benchmarks").glob("*.md")))
FRONT_PAGE = REPO_ROOT / "docs" / "benchmarks" / "README.md"
COMMAND = re.compile(r"(?:python3?|bash) scripts/\S+")
CODE_SPAN = re.compile(r"`((?:python3?|bash) scripts/[^`]*)`")
FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")


def block_commands(lines: list[str]) -> list[str]:
    """The commands of a code block's lines: a line starting with a script's command, with its `\\` continuations."""
    commands, current = [], None
    for line in lines:
        text = line.strip()
        if current is not None:
            current += " " + text.removesuffix("\\")
        elif COMMAND.match(text):
            current = text.removesuffix("\\")
        if current is not None and not text.endswith("\\"):
            commands.append(current)
            current = None
    return commands


def doc_commands(text: str) -> list[str]:
    """Every script command of a markdown text: code spans in its prose (which may wrap lines), fenced code blocks
    and code blocks indented by four spaces."""
    prose, indented, block, commands = [], [], None, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                commands += block_commands(block)
                block = None
        elif block is not None:
            block.append(line)
        elif line.startswith("    "):
            indented.append(line)
        else:
            prose.append(line)
    spans = CODE_SPAN.findall("\n".join(prose))
    return commands + block_commands(indented) + [" ".join(span.split()) for span in spans]


def script_and_flags(command: str) -> tuple[str, list[str]]:
    """The script a command runs and the flags it passes (`--name` tokens, `=value` and `[...]` brackets dropped;
    a quoted argument such as `"jaxserve[--async-scheduling],vllm"` is one token and not a flag)."""
    tokens = shlex.split(command, comments=True)
    flags = [token.strip("[]").split("=")[0] for token in tokens[2:] if token.strip("[").startswith("--")]
    return tokens[1], flags


def all_commands() -> list[tuple[str, str]]:
    return [(path.relative_to(REPO_ROOT).as_posix(), command)
            for path in DOCS for command in doc_commands(path.read_text())]


@functools.cache
def help_flags(script: str) -> frozenset[str]:
    """The flags a script's `--help` lists."""
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, f"{script} --help: exit {result.returncode}\n{result.stderr[-2000:]}"
    return frozenset(FLAG.findall(result.stdout))


def test_the_docs_name_commands():
    """The extraction finds the commands (a wrapped code span and a continued block line among them)."""
    commands = dict((command, doc) for doc, command in all_commands())
    assert len(commands) > 40
    wrapped = ('python scripts/bench_throughput.py --baseline "" --kv-cache-dtypes int8,fp8 --num-requests 64')
    assert commands[wrapped] == "docs/benchmarks/quantization.md"
    assert script_and_flags('python scripts/bench_serving.py --servers "jaxserve,jaxserve[--async-scheduling]" '
                            "--request-rates 1 [--dtype bfloat16]  # --not-a-flag") == (
        "scripts/bench_serving.py", ["--servers", "--request-rates", "--dtype"])


@pytest.mark.parametrize("doc,command", all_commands())
def test_each_command_names_a_committed_script_and_its_flags(doc, command):
    script, flags = script_and_flags(command)
    assert (REPO_ROOT / script).is_file(), f"{doc}: {command!r} names {script}, which is not in scripts/"
    if script.endswith(".py"):
        unknown = [flag for flag in flags if flag not in help_flags(script)]
        assert not unknown, f"{doc}: {command!r} passes {unknown}, which {script} --help does not list"


def front_page_rows() -> list[list[str]]:
    """The result rows of the benchmarks' front page, as cells."""
    return [line.strip().strip("|").split(" | ") for line in FRONT_PAGE.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| result |")]


def test_every_headline_result_names_a_committed_scripts_command():
    rows = front_page_rows()
    without = [cells[0] for cells in rows if not CODE_SPAN.search(cells[3])]
    assert len(rows) > 20
    assert not without, f"results whose command cell names no committed script's command: {without}"


def test_the_readme_layout_names_every_script():
    """The README's layout row for scripts/ names every script there is (and nothing that is not)."""
    row = next(line for line in (REPO_ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `scripts/` |"))
    named = set(re.findall(r"`([a-z0-9_]+\.(?:py|sh|toml))`", row))
    present = {path.name for path in (REPO_ROOT / "scripts").iterdir() if path.suffix in (".py", ".sh", ".toml")}
    assert named == present, f"not in the row: {sorted(present - named)}; not in scripts/: {sorted(named - present)}"
