"""Native XLA:CPU kernels for jaxserve: paged attention over the stacked KV pool, decode rows and
prefill chunks alike, and the write of a step's new K/V into that pool.

Place in the data flow: the "cpu" attention backend (`jaxserve.attention.backends.CpuBackend`, chosen by
"auto" on CPU) calls `paged_attention` once per layer of every step. The plain-XLA attention gathers every
page of every row into a copy before its dot products, and XLA:CPU's gather moves about 2.4 GB/s where a
copy moves 8 (docs/benchmarks/kernels-and-sampling.md), so it is bound by that copy; for prefill it also
computes the masked half of each causal square. This kernel (`paged_attention.cc`, an XLA FFI custom call)
reads the pages in place and stops at each token's own position. Its rows are ragged: row s is
`query_lens[s]` tokens of q from `query_starts[s]`, at positions `positions[s]` onwards, seeing the first
`lengths[s]` tokens of its sequence, so one call takes a padded [rows, chunk] batch (the engine's steps
today) or a flat mix of decode rows and prefill chunks. The pool may be float32 or bfloat16 (`POOL_DTYPES`;
bfloat16 also as its uint16 bits, the engine's CPU storage, see
`jaxserve.attention.kv_cache.kv_storage_dtype`), float8 e4m3 as its uint8 bits (`kv_cache_dtype="fp8"`), or
int8 with a scale per token and kv head (`kv_cache_dtype="int8"`, vLLM's int8_per_token_head): each cached K
(V) row of one token and head is int8 values times a float32 scale, max|x| / 127 when XLA wrote it, held in
`k_scales` (`v_scales`) [L, Hkv, num_blocks, block_size] beside the pool, which the kernel reads in place with
the pages. One FFI target reads them all, one compiled variant per pool type, widening bfloat16 elements (a
shift), float8 ones (a 256-entry table) and int8 rows (a conversion, times the row's scale) to float32 as it
loads them, and computes in float32. With `logit_softcap` c (Gemma 2's
attn_logit_softcapping) each scaled score s becomes c * tanh(s / c) before masking and the softmax; without
it the kernel runs a variant compiled with no trace of the cap.
The sliding window is an operand, not an attribute (0: none): a model whose layers differ in window (Gemma 2
and 3, gpt-oss) passes each layer's own from inside its layer scan, and every layer attends once, reading only
the pages its window reaches.
Attention sinks (gpt-oss: a learned logit per query head, one more term of every softmax's denominator with
no value) are an operand too, f32[Hq] or empty: a head's running softmax starts on its sink.

`write_kv_rows` (`kv_write.cc`) is the cpu backend's K/V write (`jaxserve.attention.kv_cache.write_kv`, "native"):
it copies each new token's rows into its slot of one layer, in place (its results alias the pools). XLA's scatter
does the same as fast, but XLA:CPU compiles every scatter, and the index computation feeding it, into a kernel of
its own: two of each per layer in a step of unrolled layers, which was most of the step's compile time.

The C++ sources ship with the package and are compiled on first use into one library, with the system C++
compiler against jaxlib's FFI headers, into ``$XDG_CACHE_HOME/jaxserve/kernels_cpu/<hash>/`` (hash of the
sources, the jaxlib version, the compiler command and this CPU's model and flags, since it is built for
the native instruction set). `load()` returns None, with the reason in `build_error()`, when there is no
compiler or the build fails; the backend then falls back to plain XLA.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.user_cache import cache_root

TARGET_NAME = "jaxserve_paged_attention"
WRITE_TARGET_NAME = "jaxserve_kv_write"
SOURCES = (Path(__file__).with_name("paged_attention.cc"), Path(__file__).with_name("kv_write.cc"))
CXX_FLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-std=c++17", "-shared", "-fPIC",
    # lets the dot products vectorize (reassociated sums); infinities keep their meaning (no -ffast-math)
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
]
# what the kernel reads the KV pool as: float32, bfloat16, bfloat16 stored as its bits (uint16), float8 e4m3
# stored as its bits (uint8: the engine's float8 KV cache on CPU), or int8 with per-token-per-head scales
POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16), jnp.dtype(jnp.uint8),
               jnp.dtype(jnp.int8))
SCALED_POOL_DTYPE = jnp.dtype(jnp.int8)  # the pool that comes with k_scales and v_scales
MAX_GROUP = 16  # query heads per kv head (paged_attention.cc's kMaxGroup)
MAX_HEAD_DIM = 256  # (its kMaxHeadDim)
_build_error: str | None = None


def _cpu_description() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def library_path(compiler: str) -> Path:
    """Where the shared library for this source, jaxlib, compiler and CPU lives."""
    import jaxlib

    key = hashlib.sha256()
    sources = [source.read_bytes() for source in SOURCES]
    for part in (*sources, jaxlib.__version__.encode(), compiler.encode(), " ".join(CXX_FLAGS).encode(),
                 _cpu_description().encode()):
        key.update(part)
    return cache_root() / "kernels_cpu" / key.hexdigest()[:24] / "libjaxserve_kernels_cpu.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *CXX_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        built.replace(target)  # atomic: a concurrent build of the same key writes the same bytes


@functools.cache
def load() -> ctypes.CDLL | None:
    """Builds (once per machine and source) and registers the kernel; None if it cannot be built."""
    global _build_error
    compiler = _compiler()
    if compiler is None:
        _build_error = "no C++ compiler found (set CXX, or install g++)"
        return None
    target = library_path(compiler)
    try:
        if not target.is_file():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (RuntimeError, OSError) as err:
        _build_error = str(err)
        return None
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(library.PagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET_NAME, jax.ffi.pycapsule(library.KvWrite), platform="cpu")
    return library


def build_error() -> str | None:
    """Why `load()` returned None (None if it has not failed)."""
    return _build_error


def require(user: str) -> None:
    """`load()`, or a RuntimeError naming ``user`` (what needs the kernels) and why they could not be built."""
    if load() is None:
        raise RuntimeError(f"{user} could not be built: {build_error()}")


def _check_pool_dtypes(k_pool: jax.Array, v_pool: jax.Array) -> None:
    if k_pool.dtype not in POOL_DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"the CPU paged attention reads float32, bfloat16 (or uint16 bits of bfloat16), uint8 "
                         f"bits of float8 e4m3 or int8 (with scales) KV pools (both the same dtype), "
                         f"not k_pool {k_pool.dtype} and v_pool {v_pool.dtype}")


def _pool_scales(k_pool: jax.Array, k_scales: jax.Array | None, v_scales: jax.Array | None) -> tuple:
    """The scale arrays to pass after the row arrays: both for an int8 pool, none for the others; a
    ValueError for one alone, scales with another pool, an int8 pool without them, or a wrong shape or dtype."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("give both k_scales and v_scales (with an int8 KV pool), or neither")
    scaled = k_pool.dtype == SCALED_POOL_DTYPE
    if k_scales is None:
        if scaled:
            raise ValueError("an int8 KV pool needs k_scales and v_scales: float32 [L, Hkv, num_blocks, block_size]")
        return ()
    if not scaled:
        raise ValueError(f"k_scales and v_scales go with an int8 KV pool, not a {k_pool.dtype} one")
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.dtype != jnp.float32 or tuple(scales.shape) != tuple(k_pool.shape[:-1]):
            raise ValueError(f"{name} must be float32 {list(k_pool.shape[:-1])} (the pool's shape without head_dim), "
                             f"not {scales.dtype} {list(scales.shape)}")
    return k_scales, v_scales


def _softcap_attribute(logit_softcap: float | None) -> np.float32:
    """The FFI attribute of a soft-cap: the cap, or 0 for none (None or 0)."""
    if logit_softcap is not None and not 0 <= logit_softcap < float("inf"):
        raise ValueError(f"logit_softcap must be positive and finite (None or 0: no soft-cap), not {logit_softcap}")
    return np.float32(logit_softcap or 0.0)


def _window_operand(sliding_window: int | jax.Array | None) -> jax.Array:
    """The kernel's window operand, i32[1]: 0 for no window (None or 0), else W. A Python int is checked here; a
    traced one (a layer's entry of the model's per-layer windows, inside the step) by the kernel, which refuses
    a negative one."""
    if sliding_window is None:
        return jnp.zeros((1,), jnp.int32)
    if isinstance(sliding_window, (bool, float)) or (isinstance(sliding_window, int) and sliding_window < 0):
        raise ValueError(f"sliding_window must be an int >= 1 (None or 0: no window), got {sliding_window!r}")
    return jnp.asarray(sliding_window, jnp.int32).reshape(1)


def _sinks_operand(sinks: jax.Array | None, num_q_heads: int) -> jax.Array:
    """The kernel's sinks operand: f32[Hq], or f32[0] for none."""
    if sinks is None:
        return jnp.zeros((0,), jnp.float32)
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must be [{num_q_heads}] (one logit per query head), not {list(sinks.shape)}")
    return sinks.astype(jnp.float32)


def paged_attention(
    q: jax.Array,  # f32[T, Hq, D]: every row's query tokens, back to back (other float dtypes are cast to f32)
    k_pool: jax.Array,  # f32, bf16, u16 (bf16 bits), u8 (e4m3 bits) or i8 [L, Hkv, num_blocks, block_size, D]
    v_pool: jax.Array,  # the same shape and dtype as k_pool
    layer: jax.Array,  # i32[]
    block_tables: jax.Array,  # i32[S, P]
    query_starts: jax.Array,  # i32[S]: row s's first token in q
    query_lens: jax.Array,  # i32[S]: row s's tokens in q
    positions: jax.Array,  # i32[S]: the position of row s's first token in its sequence
    lengths: jax.Array,  # i32[S]: tokens of row s's sequence it may see (those of its own tokens included)
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # W, or 0 / None for none; may be traced (i32[])
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]: a logit per query head in every softmax's denominator (gpt-oss)
    k_scales: jax.Array | None = None,  # f32[L, Hkv, num_blocks, block_size]: with an int8 pool only
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Token i of row s, at position ``positions[s] + i``, attends causally over its sequence's cached tokens
    up to itself (the last ``sliding_window`` of them if set, a Python int or a traced i32 scalar, 0 for none:
    the window is an operand, so one compiled call serves a step's sliding and full layers alike); tokens at or
    past ``lengths[s]``, and tokens of q that belong to no row, give zeros. With ``logit_softcap`` c, each score
    s = (q . k) * sm_scale becomes c * tanh(s / c) before masking and the softmax. With ``sinks``, query head
    h's softmax has one more term, exp(sinks[h]), in its denominator and none in its sum of values (gpt-oss's
    attention sinks). An int8 pool's cached token t of block b, kv head h, holds
    ``k_pool[layer, h, b, t] * k_scales[layer, h, b, t]`` (and so V with ``v_scales``); the kernel reads the
    scales in place, only those of the tokens it reads. Returns f32[T, Hq, D], computed in float32 whatever the
    pool dtype. Raises ValueError for a pool dtype not in `POOL_DTYPES` (or two different ones), for scales
    missing, alone, of the wrong shape or dtype or with another pool than int8, for a negative Python
    ``sliding_window``, for sinks not of shape [Hq] and for a negative, infinite or NaN ``logit_softcap``. Call
    `load()` first."""
    _check_pool_dtypes(k_pool, v_pool)
    scales = _pool_scales(k_pool, k_scales, v_scales)
    softcap = _softcap_attribute(logit_softcap)
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    rows = [jnp.asarray(x).astype(jnp.int32) for x in (block_tables, query_starts, query_lens, positions, lengths)]
    return call(
        q.astype(jnp.float32), k_pool, v_pool, jnp.asarray(layer, jnp.int32).reshape(1), *rows,
        _window_operand(sliding_window), _sinks_operand(sinks, q.shape[1]), *scales, sm_scale=np.float32(sm_scale),
        logit_softcap=softcap,
    )


def padded_paged_attention(
    q: jax.Array,  # [S, Q, Hq, D]: Q query tokens per row, the first at q_start[s]
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,  # i32[S, P]
    q_start: jax.Array,  # i32[S]
    lengths: jax.Array,  # i32[S]: tokens of the sequence after this step; query tokens at or past it are padding
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """`paged_attention` on the engine's padded layout (a decode step is Q = 1, q_start = lengths - 1), with
    the same sliding window, logit soft-cap, sinks and int8 pool scales; returns f32[S, Q, Hq, D], zeros for padding
    tokens and rows."""
    num_rows, num_query = q.shape[:2]
    out = paged_attention(
        q.reshape(num_rows * num_query, *q.shape[2:]), k_pool, v_pool, layer, block_tables,
        jnp.arange(num_rows, dtype=jnp.int32) * num_query, jnp.full((num_rows,), num_query, jnp.int32),
        q_start, lengths, sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
        sinks=sinks, k_scales=k_scales, v_scales=v_scales,
    )
    return out.reshape(q.shape)


def write_kv_rows(
    k_pool: jax.Array,  # [L, Hkv, ...]: slots of `row` elements after the kv heads, any dtype
    v_pool: jax.Array,  # the same shape and dtype as k_pool
    layer: jax.Array,  # i32[]
    k_rows: jax.Array,  # [N, Hkv, row], k_pool's dtype
    v_rows: jax.Array,  # as k_rows
    slots: jax.Array,  # i32[N]: row n's slot; one outside the pool (padding) is skipped
) -> tuple[jax.Array, jax.Array]:
    """(k_pool, v_pool) with row n of ``k_rows`` / ``v_rows`` at slot ``slots[n]`` of ``layer``, every kv head,
    written in place by `kv_write.cc` (the results alias the pools): the K/V pages of a step (rows of head_dim
    values) or an int8 pool's scales (rows of one). Raises ValueError for rows of another dtype than their pool
    or pools of two shapes. Call `load()` first."""
    if k_rows.dtype != k_pool.dtype or v_rows.dtype != v_pool.dtype or k_pool.shape != v_pool.shape:
        raise ValueError(f"K/V rows must have their pool's dtype and the pools one shape: pools {k_pool.dtype}"
                         f"{list(k_pool.shape)} and {v_pool.dtype}{list(v_pool.shape)}, rows {k_rows.dtype} and "
                         f"{v_rows.dtype}")
    results = (jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype))
    call = jax.ffi.ffi_call(WRITE_TARGET_NAME, results, input_output_aliases={0: 0, 1: 1})
    return call(k_pool, v_pool, k_rows, v_rows, jnp.asarray(slots, jnp.int32),
                jnp.asarray(layer, jnp.int32).reshape(1))
