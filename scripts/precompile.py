"""Compile every bucket of an engine configuration into JAX's persistent compilation cache.

The same command as `jaxserve precompile` (see `jaxserve precompile --help`), e.g.

    python scripts/precompile.py --model path/to/hf_dir --buckets gpu --compile-cache-dir /cache/jaxserve
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jaxserve.entrypoints.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["precompile", *sys.argv[1:]]))
