"""Rotary position embeddings of the rotary families, computed as transformers does (default, `linear`,
`llama3`, LongRoPE and YaRN frequency scaling; partial rotary of Phi-4-mini; Gemma 3's second embedding for its
sliding-window layers); the attention layer rotates q and k with them before writing k to the pool."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.rope_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """f32[head_dim // 2] (`head_dim`: the rotated features), computed as transformers does (including `llama3`,
    `linear` and `longrope` scaling)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    if rope.rope_type == "longrope":
        factors = np.asarray(rope.long_factor if rope.long_context else rope.short_factor, np.float32)
        return (np.float32(1.0) / (factors * np.float32(rope.theta) ** exponents)).astype(np.float32)
    pos_freqs = np.float32(rope.theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.frequency_factors is not None:  # llama.cpp's rope_freqs: theta_i / factor_i
        inv_freq = (inv_freq / np.asarray(rope.frequency_factors, np.float32)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, pos_freqs, rope, head_dim)
    return inv_freq


def _llama3_inv_freq(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, pos_freqs: np.ndarray, rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those turning more than `beta_fast` times kept, with a linear ramp between."""

    def correction_dim(num_rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - keep) + inv_freq * keep).astype(np.float32)


def rotary_cos_sin(positions: jax.Array, rope: RopeConfig, rotary_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[S, Q, rotary_dim] for the rotate-half convention, times `rope.attention_factor`."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(rope, rotary_dim))[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if rope.attention_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * rope.attention_factor, jnp.sin(emb) * rope.attention_factor


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [S, Q, H, D]; rotates pairs (i, i + R/2) of its first R features (R: cos's last axis, D or less
    for partial rotary) as transformers' `rotate_half`; the other features pass unchanged."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else jnp.concatenate([out, x_pass], axis=-1)
