"""The per-user cache root of jaxserve: ``$XDG_CACHE_HOME/jaxserve`` (``~/.cache/jaxserve`` by default).

Place in the data flow: everything jaxserve keeps between runs lives under it, each user in its own
subdirectory: the compile cache (`compile_cache.default_cache_dir`), tokenizers converted from GGUF files
(`weights.tokenizer_cache_dir`), weights converted from GGUF files
(`weights.converted_cache`) and the native CPU kernel's shared library (`kernels_cpu`).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/jaxserve``, or ``~/.cache/jaxserve`` when the variable is unset or empty."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve"
