"""Reading a layer's parameters in the forward pass: `weight`, for every parameter the models declare.

Place in the data flow: each model's `__call__` (traced once per step program) reads its weights through it.
Flax's `Module.param` checks an existing parameter's shape by tracing its initializer under `jax.eval_shape`,
about 1.4 ms a parameter: 0.4 s of the 0.5 s it took to trace a step of the embedded model (273 parameters).
`weight` checks the shape directly and runs the initializer only where a parameter is created (`init`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import numpy as np
from flax import errors


def weight(module: nn.Module, name: str, init: Callable, shape: Sequence[int], dtype):
    """``module.param(name, init, shape, dtype)``, but an existing parameter is returned after comparing its shape
    with ``shape`` (flax's ScopeParamShapeError if they differ), without tracing ``init``."""
    if not module.has_variable("params", name):
        return module.param(name, init, tuple(shape), dtype)
    value = module.get_variable("params", name)
    if np.shape(value) != tuple(shape):
        raise errors.ScopeParamShapeError(name, module.scope.path_text, np.shape(value), tuple(shape))
    return value
