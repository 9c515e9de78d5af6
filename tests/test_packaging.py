"""The wheel ships the bucket specs as package data, and an installed (non-editable) jaxserve finds them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.paths import REPO_ROOT

SHIPPED = sorted(p.name for p in (REPO_ROOT / "jaxserve" / "_buckets").glob("*.toml"))


def _build_wheel(tmp_path: Path) -> Path:
    """Builds from a copy of the sources, so no build/ or egg-info lands in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("jaxserve", "kernels_pallas"):
        shutil.copytree(REPO_ROOT / package, src / package, ignore=ignore)
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = out.glob("jaxserve-*.whl")
    return wheel


def test_wheel_ships_bucket_specs_and_installed_package_loads_them(tmp_path):
    assert SHIPPED == ["cpu.toml", "gpu.toml", "tpu.toml"]
    assert (REPO_ROOT / "buckets").resolve() == (REPO_ROOT / "jaxserve" / "_buckets").resolve()  # the repo-root link
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        # the helpers tests and scripts share ship too (`jaxserve*`); they need the test extra, and nothing imports them
        assert "jaxserve/testing/tiny_models.py" in zf.namelist()
        packaged = sorted(n.rsplit("/", 1)[1] for n in zf.namelist() if n.startswith("jaxserve/_buckets/"))
        assert packaged == SHIPPED
        for name in SHIPPED:
            assert zf.read(f"jaxserve/_buckets/{name}").decode() == (REPO_ROOT / "buckets" / name).read_text()
        site = tmp_path / "site"
        zf.extractall(site)
    # A fresh interpreter that imports jaxserve from the unpacked wheel (no checkout next to it).
    probe = (
        "import json, jaxserve; from jaxserve.core.buckets import available_bucket_specs, load_bucket_spec; "
        "spec = load_bucket_spec(None, 'cpu'); "
        "print(json.dumps([jaxserve.__file__, spec.source, available_bucket_specs(), spec.context_lengths]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=120
    )
    module_file, source, names, contexts = json.loads(result.stdout)
    assert Path(module_file) == site / "jaxserve" / "__init__.py"
    assert Path(source) == site / "jaxserve" / "_buckets" / "cpu.toml"
    assert names == ["cpu", "gpu", "tpu"]
    from jaxserve.core.buckets import load_bucket_spec

    assert contexts == list(load_bucket_spec("cpu", "cpu").context_lengths)
