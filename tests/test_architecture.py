"""The package's shape: imports point down the layers of the data flow (README, "Layout"), no module imports
itself back through others, `jaxserve.core` runs without JAX, every module says its place in a docstring, the
README's layout table names every folder and module there is (and nothing that is not), and the public API
resolves from the package root.

The import graph is read from the source (every `import` statement, those inside functions too), so a lazy
import cannot hide a cycle or an upward dependency."""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

PACKAGES = ("jaxserve", "kernels_pallas", "kernels_cpu")
# Lowest first. A module may import from its own group and from groups of lower layers, nothing above and
# no other group of its own layer. A group is a folder of jaxserve/ or a top-level module.
LAYERS = (
    {"jaxserve.logger", "jaxserve.math_utils", "jaxserve.user_cache", "jaxserve.config", "jaxserve.outputs",
     "jaxserve.wire", "jaxserve.json_schemas"},
    {"jaxserve.sampling_params", "jaxserve.precision", "jaxserve.reductions"},
    {"jaxserve.core", "jaxserve.metrics", "jaxserve.distributed", "kernels_pallas", "kernels_cpu"},
    {"jaxserve.attention", "jaxserve.quantization"},
    {"jaxserve.models", "jaxserve.weights"},
    {"jaxserve.runner"},
    {"jaxserve.speculative"},  # draft proposers: host side, or a draft model on its own runner
    {"jaxserve.compilation"},
    {"jaxserve.replication"},  # multi-host serving: host 0's runner calls replayed on the other hosts
    {"jaxserve.engine"},
    {"jaxserve.engine_core"},  # the engine in a process of its own, its messages, data parallel cores
    {"jaxserve.llm", "jaxserve"},  # the public API: the offline LLM and the package root's lazy exports
    {"jaxserve.entrypoints"},
    {"jaxserve.testing"},  # what tests and scripts share: may import any of the package, imported by none of it
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in sorted((REPO_ROOT / package).rglob("*.py"))}


def _import_statements(path: Path):
    """(module, names) of every absolute import in ``path``: `import a.b` gives ("a.b", []), `from a import b, c`
    gives ("a", ["b", "c"])."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]


def _imports(name: str) -> set[str]:
    """The package's modules that ``name`` imports (`from package import module` imports the module)."""
    found = set()
    for module, names in _import_statements(MODULES[name]):
        submodules = {f"{module}.{alias}" for alias in names} & MODULES.keys()
        found |= submodules or {module}
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _group(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "jaxserve" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def _layer(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def _cycle() -> list[str] | None:
    """One import cycle of the module graph, or None (depth-first search for a back edge)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_module_imports_itself_back_through_others():
    assert _cycle() is None, " -> ".join(_cycle())


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    monkeypatch.setitem(GRAPH, "jaxserve.core.sequence", GRAPH["jaxserve.core.sequence"] | {"jaxserve.core.scheduler"})
    cycle = _cycle()  # the scheduler imports the sequence (directly, and through the block manager)
    assert cycle[0] == cycle[-1] and {"jaxserve.core.sequence", "jaxserve.core.scheduler"} <= set(cycle)
    assert all(b in GRAPH[a] for a, b in zip(cycle[:-1], cycle[1:], strict=True))


def test_every_group_has_a_layer():
    groups = {_group(module) for module in MODULES}
    assert groups == set().union(*LAYERS)


def _upward() -> list[str]:
    """Every import of a group of the same layer or above, as "module imports dep"."""
    return [
        f"{module} imports {dep}"
        for module, deps in sorted(GRAPH.items())
        for dep in sorted(deps)
        if _group(dep) != _group(module) and _layer(_group(dep)) >= _layer(_group(module))
    ]


def test_imports_point_down_the_layers():
    assert _upward() == []


@pytest.mark.parametrize("dep", ["jaxserve.engine_core.core_process", "jaxserve.engine.llm_engine"])
def test_the_layer_check_finds_an_upward_import(monkeypatch, dep):
    """Multi-host serving sits below the engine and its core process, which import it: an import back is reported."""
    assert "jaxserve.replication.serving_hosts" in GRAPH["jaxserve.engine_core.core_process"]  # the real, downward one
    monkeypatch.setitem(GRAPH, "jaxserve.replication.serving_hosts",
                        GRAPH["jaxserve.replication.serving_hosts"] | {dep})
    assert _upward() == [f"jaxserve.replication.serving_hosts imports {dep}"]


def test_core_imports_without_jax():
    """Every module of jaxserve.core in a process where jax, jaxlib and flax cannot be imported; the same
    blocker stops the runner, so the check cannot pass by accident."""
    script = textwrap.dedent("""
        import importlib, importlib.abc, pkgutil, sys
        class NoJax(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        sys.meta_path.insert(0, NoJax())
        import jaxserve.core
        names = [m.name for m in pkgutil.walk_packages(jaxserve.core.__path__, "jaxserve.core.")]
        for name in names:
            importlib.import_module(name)
        assert not any(m.split(".")[0] in ("jax", "jaxlib", "flax") for m in sys.modules), "jax was imported"
        try:
            importlib.import_module("jaxserve.runner.model_runner")
        except ModuleNotFoundError as err:
            print("runner blocked:", err)
        print("core:", " ".join(sorted(names)))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "runner blocked: No module named 'jax' (blocked)" in result.stdout
    core = result.stdout.split("core: ", 1)[1].split()
    assert {"jaxserve.core.scheduler", "jaxserve.core.schedule", "jaxserve.core.block_manager",
            "jaxserve.core.buckets", "jaxserve.core.prefix_cache", "jaxserve.core.sequence"} <= set(core)


def test_every_module_says_its_place_in_a_docstring():
    missing = [name for name, path in MODULES.items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


def test_the_public_api_resolves_from_the_package_root():
    """What users import today, `from jaxserve import LLM, SamplingParams, ...`, finds each name wherever its
    module now lives (the root's exports are lazy: a stale path would fail only when a user asks)."""
    import jaxserve
    from jaxserve.entrypoints import api_server

    assert {name: getattr(jaxserve, name).__name__ for name in jaxserve.__all__} == {n: n for n in jaxserve.__all__}
    assert {"LLM", "SamplingParams", "LLMEngine", "AsyncLLMEngine", "StructuredOutputsParams"} <= set(jaxserve.__all__)
    assert callable(api_server.main) and callable(api_server.build_app)
    with pytest.raises(AttributeError, match="module 'jaxserve' has no attribute 'Engine'"):
        jaxserve.Engine  # noqa: B018


def _readme_layout_rows() -> list[tuple[list[str], str]]:
    """The README's layout table: each row's paths (first column) and the rest of its text."""
    section = (REPO_ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in section.splitlines() if line.startswith("| `")]
    return [(re.findall(r"`([^`]+)`", paths), text) for paths, text in rows]


def test_the_readme_layout_names_every_folder_and_module_of_the_package():
    """A folder of jaxserve/ has a row of its own that names each of its modules (a `*` stands for several);
    a top-level module is named in the rows of the top level."""
    rows = _readme_layout_rows()
    named = {paths[0]: re.findall(r"`([\w*]+\.py)`", text) for paths, text in rows
             if len(paths) == 1 and paths[0].endswith("/")}
    named["jaxserve/"] = [Path(path).name for paths, _ in rows if paths[0].startswith("jaxserve/")
                          and paths[0].endswith(".py") for path in paths]
    unnamed = []
    for name, path in MODULES.items():
        folder = path.parent.relative_to(REPO_ROOT).as_posix() + "/"
        if not folder.startswith("jaxserve/") or path.name == "__init__.py":
            continue
        if folder not in named:
            unnamed.append(f"{folder} (no row of its own)")
        elif not any(fnmatch.fnmatch(path.name, pattern) for pattern in named[folder]):
            unnamed.append(name)
    assert sorted(set(unnamed)) == []


def test_every_path_the_readme_layout_names_exists():
    missing = []
    for paths, text in _readme_layout_rows():
        folder = REPO_ROOT / paths[0] if len(paths) == 1 and paths[0].endswith("/") else None
        missing += [path for path in paths if "/" in path and not (REPO_ROOT / path).exists()]
        if folder is not None:
            missing += [f"{paths[0]}{name}" for name in re.findall(r"`([\w]+\.(?:py|toml))`", text)
                        if not (folder / name).exists()]
    assert missing == []


def _runner_modules_of(group: str) -> set[str]:
    return {dep for module, deps in GRAPH.items() if _group(module) == group
            for dep in deps if _group(dep) == "jaxserve.runner"}


def test_the_request_loop_reaches_the_device_through_the_step_runner_alone():
    """engine/ imports two runner modules, the step interface and the sampling row its groups fill in, and names
    no sampler column: the step runner packs them (`runner/step_runner.py`)."""
    assert _runner_modules_of("jaxserve.engine") == {"jaxserve.runner.step_runner", "jaxserve.runner.sampler"}
    column_names = re.compile(r"\b(INT_COLUMNS|FLOAT_COLUMNS)\b")
    naming = [name for name, path in MODULES.items() if _group(name) == "jaxserve.engine"
              and column_names.search(path.read_text())]
    assert naming == []


def test_the_runner_import_check_finds_a_planted_import(monkeypatch):
    llm_engine = "jaxserve.engine.llm_engine"
    monkeypatch.setitem(GRAPH, llm_engine, GRAPH[llm_engine] | {"jaxserve.runner.model_runner"})
    assert "jaxserve.runner.model_runner" in _runner_modules_of("jaxserve.engine")


def _code_lines(module: str) -> int:
    return len(MODULES[module].read_text().splitlines())


def test_the_request_loop_stays_small():
    """The engine's loop is read first: llm_engine.py at most 450 lines importing at most 20 of the package's
    modules; engine/ at most 13 modules; no configuration module over 400 lines."""
    assert _code_lines("jaxserve.engine.llm_engine") <= 450
    assert len({dep for dep in GRAPH["jaxserve.engine.llm_engine"] if dep.startswith("jaxserve.")}) <= 20
    engine_modules = [name for name, path in MODULES.items() if _group(name) == "jaxserve.engine"
                      and path.name != "__init__.py"]
    assert len(engine_modules) <= 13, engine_modules
    oversized = [name for name in MODULES if _group(name) == "jaxserve.config" and _code_lines(name) > 400]
    assert oversized == []


def test_no_script_imports_the_tests():
    """Scripts stand on the package (`jaxserve.testing` holds what scripts and tests share)."""
    importing = [path.name for path in sorted((REPO_ROOT / "scripts").rglob("*.py"))
                 if any(module.split(".")[0] == "tests" for module, _ in _import_statements(path))]
    assert importing == []


def test_the_package_imports_configuration_from_its_topic_modules():
    """`jaxserve.config` re-exports its topics for users; the package itself names the module that holds each."""
    through_the_root = [name for name, deps in sorted(GRAPH.items())
                        if "jaxserve.config" in deps and _group(name) != "jaxserve.config"]
    assert through_the_root == []
