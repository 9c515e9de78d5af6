"""quantization="gguf": a GGUF file's quantized blocks served as int8 codes with a scale and an offset per 32 weights.

The kept types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K) rebuild gguf's own dequantized values bit for bit, other
types land within half a level; an engine on a tiny Llama GGUF whose layers are stored in five of the kept types gives
transformers' greedy tokens on the same file (transformers dequantizes it), with int8 kernels on the device. The
real Gemma 3 270M Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 layers) is measured in docs/benchmarks/quantization.md."""

from __future__ import annotations

import dataclasses
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.config.quantization_config import parse_quantization
from jaxserve.distributed.sharding import check_tensor_parallel, param_spec
from jaxserve.models.common import matmul
from jaxserve.quantization.matmul import grouped_matmul
from jaxserve.quantization.weights import dequantize_groups, quantize_groups
from jaxserve.testing.hf_reference import greedy_continuation
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_gguf import QUANTIZED_LAYER_TYPES, make_tiny_gguf
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from jaxserve.weights.gguf_blocks import grouped_codes
from jaxserve.weights.gguf_file import dequantize_tensor
from tests.forward import PagedForward

Q = gguf.GGMLQuantizationType
# where a K-quant super-block keeps its f16 scales (bytes), set to sane values in random blocks
K_QUANT_HALVES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
PROMPTS = [[5, 77, 140, 9, 33, 201, 18, 64, 7, 120, 99], [250, 3, 41]]
MAX_TOKENS = 8


def _tensor(shape: tuple[int, int], kind, seed: int = 0) -> types.SimpleNamespace:
    """A GGUF tensor as `gguf.GGUFReader` gives it: [out, in] values stored as ``kind`` (shape in GGUF order):
    gguf's quantizer on random values, or random blocks for the K-quants, which it cannot write."""
    rng = np.random.default_rng(seed)
    if kind in K_QUANT_HALVES:
        block_size, type_size = gguf.constants.GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
        for start in K_QUANT_HALVES[kind]:
            halves = rng.uniform(0.001, 0.01, data.shape[:2] + (1,)).astype(np.float16)
            data[..., start:start + 2] = halves.view(np.uint8)
        data = data.reshape(shape[0], -1)
    else:
        values = rng.normal(0.0, 0.2, shape).astype(np.float32)
        values[0, :32] = 0.5  # a constant block
        data = values.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(values, kind)
    return types.SimpleNamespace(name="t", tensor_type=kind, shape=shape[::-1], data=data)


def _rebuilt(tensor) -> np.ndarray:
    codes, scale, offset = grouped_codes(tensor, dequantize_tensor)
    return dequantize_groups(codes.T, scale.T, offset.T).T


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K], ids=lambda k: k.name)
def test_kept_types_rebuild_gguf_s_dequantized_values_bit_for_bit(kind):
    tensor = _tensor((6, 512), kind)
    codes, scale, offset = grouped_codes(tensor, dequantize_tensor)
    assert codes.dtype == np.int8 and codes.shape == (6, 512)
    assert scale.shape == offset.shape == (6, 16) and scale.dtype == offset.dtype == np.float32
    np.testing.assert_array_equal(_rebuilt(tensor), dequantize_tensor(tensor))
    low, high = {Q.Q8_0: (-127, 127), Q.Q4_0: (-8, 7), Q.Q4_1: (0, 15), Q.Q5_0: (-16, 15), Q.Q5_1: (0, 31),
                 Q.Q4_K: (0, 15), Q.Q5_K: (0, 31)}[kind]
    assert low <= codes.min() and codes.max() <= high


@pytest.mark.parametrize("kind", [Q.Q6_K, Q.F16], ids=lambda k: k.name)
def test_other_types_land_within_half_a_level_of_their_values(kind):
    tensor = _tensor((4, 256), kind, seed=1)
    _, scale, _ = grouped_codes(tensor, dequantize_tensor)
    error = np.abs(_rebuilt(tensor) - dequantize_tensor(tensor)).reshape(4, 8, 32).max(axis=-1)
    assert (error <= scale / 2 * (1 + 1e-5)).all() and error.max() > 0


def test_quantize_groups_spans_each_group_with_256_levels():
    kernel = np.zeros((64, 2), np.float32)  # [in 64, out 2]: two groups of 32 per output channel
    kernel[:32, 0] = np.linspace(-1.0, 2.0, 32)
    kernel[32:, 0] = 3.0  # a constant group: scale 1, its value as offset + 0 * scale
    kernel[:, 1] = np.linspace(0.0, 255.0, 64)
    codes, scale, offset = quantize_groups(kernel, 32)
    np.testing.assert_allclose(scale, [[3.0 / 255, 31 * 255 / 63 / 255], [1.0, 31 * 255 / 63 / 255]], rtol=1e-6)
    assert codes[0, 0] == -128 and codes[31, 0] == 127 and (codes[32:, 0] == -128).all()
    np.testing.assert_allclose(offset[:, 0], [-1.0 + 128 * 3.0 / 255, 3.0 + 128], rtol=1e-6)
    rebuilt = dequantize_groups(codes, scale, offset)
    assert rebuilt[40, 0] == 3.0 - 128 + 128
    assert (np.abs(rebuilt - kernel).reshape(2, 32, 2).max(axis=1) <= scale / 2 * (1 + 1e-5)).all()
    abstract = quantize_groups(jax.ShapeDtypeStruct((3, 64, 2), np.float32), 32)
    assert [(a.shape, a.dtype) for a in abstract] == [((3, 64, 2), np.int8), ((3, 2, 2), np.float32),
                                                      ((3, 2, 2), np.float32)]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf_blocks")
    hf_dir = make_tiny_model(directory / "hf", "llama", seed=5)
    return make_tiny_gguf(directory / "tiny.gguf", hf_dir, QUANTIZED_LAYER_TYPES)


def test_the_loader_keeps_int8_codes_equal_to_the_float_load(gguf_path):
    kept = load_model(str(gguf_path), "float32", quantization="gguf")
    float_load = load_model(str(gguf_path), "float32")
    assert kept.config.quantization == parse_quantization("gguf")
    for module, name in (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("mlp", "down_proj")):
        leaf = kept.params["params"]["layers"][module][name]
        kernel = float_load.params["params"]["layers"][module][name]["kernel"]  # [L, in, out]
        assert leaf["kernel"].dtype == np.int8 and leaf["kernel"].shape == kernel.shape
        assert leaf["group_scale"].shape == leaf["group_offset"].shape == (2, kernel.shape[1] // 32, kernel.shape[2])
        np.testing.assert_array_equal(dequantize_groups(leaf["kernel"], leaf["group_scale"], leaf["group_offset"]),
                                      kernel)
    assert kept.params["params"]["embed_tokens"]["embedding"].dtype == np.float32


def test_products_group_by_group_give_the_rebuilt_weight_s_logits(gguf_path):
    """Off CPU each group's product runs on its codes and the scales weigh the results; on CPU the weight is rebuilt
    first: the same logits (float32; the two differ in rounding only)."""
    kept = load_model(str(gguf_path), "float32", quantization="gguf")
    scheme = kept.config.quantization
    assert not scheme.for_platform("cpu").group_products
    assert scheme.for_platform("tpu").group_products and scheme.for_platform("cuda").group_products
    grouped = dataclasses.replace(kept.config, quantization=scheme.for_platform("tpu"))
    tokens, table = PROMPTS[0], [2, 0, 1]
    rebuilt = PagedForward(kept.config, kept.params, block_size=4).run(tokens, table, [8, 1, 1, 1])
    np.testing.assert_allclose(PagedForward(grouped, kept.params, block_size=4).run(tokens, table, [8, 1, 1, 1]),
                               rebuilt, atol=2e-5, rtol=0)


def test_on_tpu_products_group_by_group_never_write_the_rebuilt_weight():
    """Deviceless, one v5e chip, a Llama-3-8B MLP matrix: XLA writes a rebuilt weight to HBM (float32, 4 bytes per
    weight) and reads it back; group by group it needs no temporaries at decode sizes."""
    from jaxserve.compilation.targets import resolve_target

    device = resolve_target("v5e:2x2").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    inputs, outputs = 4096, 14336
    shapes = [((16, inputs), jnp.bfloat16), ((inputs, outputs), jnp.int8), ((inputs // 32, outputs), jnp.float32),
              ((inputs // 32, outputs), jnp.float32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    temporaries = {}
    for platform in ("cpu", "tpu"):
        scheme = parse_quantization("gguf").for_platform(platform)
        product = jax.jit(lambda x, c, s, o, scheme=scheme: grouped_matmul(x, c, s, o, scheme, jnp.bfloat16, matmul))
        temporaries[platform] = product.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temporaries["cpu"] >= inputs * outputs * 4 and temporaries["tpu"] == 0


def test_engine_greedy_tokens_equal_transformers_on_the_quantized_file(gguf_path, tmp_path):
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,))
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=128, buckets=buckets, quantization="gguf")
    assert llm.llm_engine.model_config.quantization.name == "gguf"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32).eval()
    assert [o.outputs[0].token_ids for o in outputs] == [greedy_continuation(model, p, MAX_TOKENS) for p in PROMPTS]


def test_gguf_quantization_is_refused_for_other_files_and_for_experts(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", seed=1)
    with pytest.raises(ValueError, match=r"^quantization='gguf' serves a GGUF file's quantized blocks as stored, "
                                         r"and .*/hf is not a \.gguf file: give a \.gguf file, or "
                                         r"quantization='int8' for int8 weights$"):
        load_model(str(hf_dir), "float32", quantization="gguf")
    moe = make_tiny_gguf(tmp_path / "moe.gguf", make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2))
    with pytest.raises(ValueError, match=r"^quantization='gguf' does not serve mixture-of-experts models yet; "
                                         r"quantization='int8' does$"):
        load_model(str(moe), "float32", quantization="gguf")


def test_row_parallel_group_scales_split_with_the_kernel_s_inputs():
    for leaf in ("kernel", "group_scale", "group_offset"):
        assert param_spec(("params", "layers", "mlp", "down_proj", leaf), 3) == P(None, "tp", None)
        assert param_spec(("params", "layers", "mlp", "up_proj", leaf), 3) == P(None, None, "tp")


def test_tensor_parallel_must_divide_the_row_parallel_groups(gguf_path):
    config = load_model(str(gguf_path), "float32", quantization="gguf").config  # o_proj: 2 groups, down_proj: 4
    check_tensor_parallel(config, 2)
    wide = dataclasses.replace(config, num_heads=6, num_kv_heads=2)  # o_proj: 6 x 16 = 96 inputs, 3 groups
    with pytest.raises(ValueError, match=r"^the model's groups of 32 inputs of o_proj \(3\) is not divisible by "
                                         r"tensor_parallel_size \(2\)"):
        check_tensor_parallel(wide, 2)
