"""The `jaxserve` logger: INFO to stderr by default, as vLLM's (set JAXSERVE_LOGGING_LEVEL to change it)."""

from __future__ import annotations

import logging
import os


def init_logger(name: str = "jaxserve") -> logging.Logger:
    root = logging.getLogger("jaxserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("JAXSERVE_LOGGING_LEVEL", "INFO"))
        root.propagate = False
    return logging.getLogger(name)
