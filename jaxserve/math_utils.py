"""Integer arithmetic the host-side bookkeeping and the step builders share (no JAX)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (numpy and JAX integer arrays too)."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``value``."""
    return cdiv(value, multiple) * multiple
