"""The latent (MLA) decode kernel, both variants in interpret mode, against its plain-jnp reference and a naive
numpy attention; its lowering for real hardware (Mosaic, Triton); what it refuses.

Every pool slot that no sequence uses below its length holds NaN (unused pages, the tail of a last page, the pages
block-table padding points at): a kernel that reads a token it should not returns NaN."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla_attention import mla_decode_attention, mla_decode_attention_reference
from tests.kernels.conftest import LOWERING_PLATFORMS, TOLERANCES

RANK, ROPE = 128, 64


@dataclasses.dataclass
class LatentPool:
    pool: jnp.ndarray  # [num_layers, 1, total_pages, page_size, width]
    page_indices: jnp.ndarray  # i32[num_seqs, pages_per_seq]
    lengths: jnp.ndarray  # i32[num_seqs]
    rows: list  # per sequence f64[length, width], layer `layer`'s rows in token order


def make_latent_pool(rng, lengths, *, page_size=16, pages_per_seq=4, width=RANK + ROPE, dtype=jnp.float32,
                     num_layers=2, layer=1) -> LatentPool:
    num_seqs = len(lengths)
    total_pages = num_seqs * pages_per_seq + 2
    values = np.array(jnp.asarray(rng.standard_normal((num_layers, 1, total_pages, page_size, width)), dtype)
                        .astype(jnp.float32))
    perm = rng.permutation(total_pages)
    table = perm[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq).astype(np.int32)
    live = np.zeros((total_pages, page_size), bool)
    rows = []
    for s, length in enumerate(lengths):
        tokens = np.arange(length)
        live[table[s, tokens // page_size], tokens % page_size] = True
        rows.append(values[layer, 0, table[s, tokens // page_size], tokens % page_size].astype(np.float64))
        table[s, -(-length // page_size):] = perm[-1]  # padding entries point at a page of NaN
    values[:, :, ~live] = np.nan
    return LatentPool(jnp.asarray(values, dtype), jnp.asarray(table), jnp.asarray(lengths, jnp.int32), rows)


def naive_latent_attention(q: np.ndarray, rows: list, sm_scale: float) -> np.ndarray:
    """[S, H, RANK]: each head's softmax over its sequence's rows, the rows' latents as values (float64)."""
    out = np.zeros((q.shape[0], q.shape[1], RANK))
    for s, seq_rows in enumerate(rows):
        if len(seq_rows):
            scores = q[s].astype(np.float64) @ seq_rows.T * sm_scale
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[s] = (p / p.sum(axis=-1, keepdims=True)) @ seq_rows[:, :RANK]
    return out


LENGTHS = [1, 17, 64, 0, 16, 33]  # one token, mid-page, a full table, empty, page-aligned


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_the_reference_and_naive_attention(backend, dtype):
    lengths = LENGTHS
    rng = np.random.default_rng(len(lengths))
    case = make_latent_pool(rng, lengths, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), 5, RANK + ROPE)), dtype)
    args = (q, case.pool, case.lengths, case.page_indices)
    out = mla_decode_attention(*args, kv_lora_rank=RANK, layer=1, sm_scale=0.07, backend=backend, interpret=True,
                               pages_per_compute_block=2)
    ref = mla_decode_attention_reference(*args, kv_lora_rank=RANK, layer=1, sm_scale=0.07)
    assert out.shape == (len(lengths), 5, RANK) and out.dtype == dtype
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    naive = naive_latent_attention(np.asarray(q.astype(jnp.float32)), case.rows, 0.07)
    np.testing.assert_allclose(np.asarray(ref, np.float32), naive, atol=tol, rtol=tol)
    assert not np.asarray(out[np.asarray(lengths) == 0]).any()  # an empty sequence gives zeros


@pytest.mark.parametrize("backend,knobs", [("tpu", {"pages_per_compute_block": 1}),
                                           ("tpu", {"pages_per_compute_block": 4}),
                                           ("gpu", {"pages_per_compute_block": 1, "num_splits": 3}),
                                           ("gpu", {"num_splits": 1})])
def test_every_block_and_split_size_gives_the_same_answer(backend, knobs):
    rng = np.random.default_rng(7)
    case = make_latent_pool(rng, [40, 64, 3], page_size=16)
    q = jnp.asarray(rng.standard_normal((3, 4, RANK + ROPE)), jnp.float32)
    args = (q, case.pool, case.lengths, case.page_indices)
    out = mla_decode_attention(*args, kv_lora_rank=RANK, layer=1, backend=backend, interpret=True, **knobs)
    ref = mla_decode_attention_reference(*args, kv_lora_rank=RANK, layer=1)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_float8_pool_is_widened_to_the_query_dtype(backend):
    rng = np.random.default_rng(3)
    case = make_latent_pool(rng, [20, 50], dtype=jnp.float32)
    pool = case.pool.astype(jnp.float8_e4m3fn)
    q = jnp.asarray(rng.standard_normal((2, 4, RANK + ROPE)), jnp.bfloat16)
    args = (q, pool, case.lengths, case.page_indices)
    out = mla_decode_attention(*args, kv_lora_rank=RANK, layer=1, backend=backend, interpret=True)
    ref = mla_decode_attention_reference(*args, kv_lora_rank=RANK, layer=1)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)


def test_rows_padded_with_zeros_give_the_unpadded_answer():
    """The TPU engine's pool rows are padded to whole 128-lane tiles (`mla_config.latent_row_width`): the query's
    padding is zeros too, so the answer is the unpadded rows'."""
    rng = np.random.default_rng(5)
    case = make_latent_pool(rng, [30, 9])
    q = jnp.asarray(rng.standard_normal((2, 4, RANK + ROPE)), jnp.float32)
    padded_pool = jnp.pad(case.pool, [(0, 0)] * 4 + [(0, 64)])
    padded_q = jnp.pad(q, ((0, 0), (0, 0), (0, 64)))
    out = mla_decode_attention(padded_q, padded_pool, case.lengths, case.page_indices, kv_lora_rank=RANK, layer=1,
                               sm_scale=0.1, backend="tpu", interpret=True)
    want = naive_latent_attention(np.asarray(q), case.rows, 0.1)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


@LOWERING_PLATFORMS
@pytest.mark.parametrize("width", [512 + 64, 640], ids=["rows-576", "rows-640"])
@pytest.mark.parametrize("dtype,pool_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float8_e4m3fn)],
                         ids=["bf16", "bf16-fp8-pool"])
def test_lowers_for_real_hardware_at_deepseeks_shape(kernel_backend, platform, width, dtype, pool_dtype):
    """DeepSeek-V2 / V3's rows (kv_lora_rank 512, rotary 64; padded to 640 lanes as the TPU engine keeps them):
    the Mosaic / Triton lowering runs without a device, so an unsupported op fails here, not on hardware."""
    args = (jax.ShapeDtypeStruct((8, 16, width), dtype), jax.ShapeDtypeStruct((3, 1, 40, 64, width), pool_dtype),
            jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((8, 16), jnp.int32))
    traced = mla_decode_attention.trace(*args, kv_lora_rank=512, layer=jnp.int32(2), backend=kernel_backend)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text


def valid_args():
    return dict(q=jnp.zeros((2, 4, RANK + ROPE)), pool=jnp.zeros((1, 6, 16, RANK + ROPE)),
                lengths=jnp.ones((2,), jnp.int32), page_indices=jnp.zeros((2, 3), jnp.int32))


BAD_INPUTS = [
    ({"q": jnp.zeros((2, 1, 4, RANK + ROPE))}, r"q must be \[num_seqs, num_heads, kv_lora_rank \+ rope_dim\]"),
    ({"pool": jnp.zeros((2, 6, 16, RANK + ROPE))}, r"the latent pool must be one layer \[1, total_pages"),
    ({"pool": jnp.zeros((1, 6, 16, RANK + ROPE), jnp.int8)}, r"dtype must be float32, bfloat16 or float8_e4m3fn"),
    ({"q": jnp.zeros((2, 4, RANK + ROPE), jnp.bfloat16)}, r"q dtype \(bfloat16\) must be the pool's \(float32\)"),
    ({"q": jnp.zeros((2, 4, RANK + 32))}, r"q's last dimension \(160\) must match the pool rows' \(192\)"),
    ({"pool": jnp.zeros((1, 6, 8, RANK + ROPE))}, r"page_size must be one of \(16, 32, 64, 128\), got 8"),
    ({"lengths": jnp.ones((3,), jnp.int32)}, r"lengths must have shape \(num_seqs,\) = \(2,\), got \(3,\)"),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS)
def test_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        mla_decode_attention(**(valid_args() | change), kv_lora_rank=RANK, backend="gpu", interpret=True)


@pytest.mark.parametrize("width,rank,message", [
    (RANK + ROPE, 96, r"kv_lora_rank must be one of \(128, 256, 512\), got 96"),
    (RANK + 96, RANK, r"the rotary part of a latent row \(its 224 values less kv_lora_rank 128\) must be one of "
                      r"\(32, 64, 128\), got 96"),
])
def test_rejects_latent_shapes_it_has_no_layout_for(width, rank, message):
    args = valid_args() | dict(q=jnp.zeros((2, 4, width)), pool=jnp.zeros((1, 6, 16, width)))
    with pytest.raises(ValueError, match=message):
        mla_decode_attention(**args, kv_lora_rank=rank, backend="tpu", interpret=True)


@pytest.mark.parametrize("width", [640, 576], ids=["rows-640", "rows-576"])
def test_compiles_for_a_tpu_without_one_reading_the_pool_in_place(width):
    """Mosaic compiles the kernel for a v6e chip (deviceless: `jax.experimental.topologies`) at DeepSeek's shape over
    a stacked pool of 2,048 pages: in the TPU engine's 640-lane rows with no temporaries at all (the pool is read in
    place, page by page); rows of 576 values make XLA copy the whole pool into 640-lane rows first, on every call
    (why the TPU engine pads them: `mla_config.latent_row_width`)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = topologies.get_topology_desc("v6e:2x2", "tpu").devices[0]
    whole = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)
    args = (struct((8, 16, width), jnp.bfloat16), struct((3, 1, 2048, 64, width), jnp.bfloat16),
            struct((8,), jnp.int32), struct((8, 32), jnp.int32), struct((), jnp.int32))
    call = jax.jit(lambda q, pool, lengths, table, layer: mla_decode_attention(
        q, pool, lengths, table, kv_lora_rank=512, layer=layer, backend="tpu"))
    temp_bytes = call.lower(*args).compile().memory_analysis().temp_size_in_bytes
    padded_pool = 3 * 2048 * 64 * 640 * 2
    assert temp_bytes == 0 if width == 640 else padded_pool <= temp_bytes < padded_pool + 2**20
