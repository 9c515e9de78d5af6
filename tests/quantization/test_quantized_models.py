"""Quantized weights (`LLM(quantization=...)`) on a tiny random Llama, float32: every scheme's logits equal
transformers' with the same quantization applied to its model (the weights replaced by their dequantized values
and, where the scheme quantizes activations, each quantized layer's input rounded per token as the scheme does),
and the engine's greedy tokens equal transformers' generate on that model. A mixture-of-experts model's quantized
experts (weights only) give the logits of the float model on their dequantized weights."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.config.quantization_config import QUANTIZATION_CHOICES, QuantScheme, parse_quantization
from jaxserve.quantization.weights import dequantize_kernel, quantize_kernel, quantize_params
from jaxserve.testing.hf_reference import greedy_continuation
from jaxserve.testing.quantized_references import MAX_TOKENS, PROMPTS, hf_quantized
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from tests.forward import PagedForward

# every scheme that quantizes float weights (not "gguf", which serves a GGUF file's blocks: test_gguf_blocks.py) as
# it runs here, and float8 activations as a float8 matrix unit runs them (forced on this CPU)
ONLINE_SCHEMES = tuple(name for name in QUANTIZATION_CHOICES if name != "gguf")
SCHEMES = {name: parse_quantization(name).for_platform("cpu") for name in ONLINE_SCHEMES}
SCHEMES["fp8 with float8 activations"] = QuantScheme("fp8", "float8_e4m3fn", quantize_activations=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=11)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(str(model_dir), "float32")


@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_logits_equal_transformers_with_the_same_quantization(model_dir, loaded, scheme):
    config = dataclasses.replace(loaded.config, quantization=scheme)
    forward = PagedForward(config, quantize_params(loaded.params, scheme), block_size=4)
    tokens = PROMPTS[0]
    ours = forward.run(tokens, block_table=[3, 0, 2, 1], chunks=[5, 4, 1, 1])
    with torch.no_grad():
        theirs = hf_quantized(model_dir, scheme)(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("name", ONLINE_SCHEMES)
def test_engine_greedy_tokens_equal_transformers_generate(model_dir, tmp_path, name):
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,))
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, buckets=buckets, quantization=name)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = hf_quantized(model_dir, SCHEMES[name])
    assert [o.outputs[0].token_ids for o in outputs] == [greedy_continuation(model, p, MAX_TOKENS) for p in PROMPTS]


def _dequantized(tree):
    """A quantized parameter tree with every quantized array replaced by the float32 weight it stands for."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if key.endswith("_scale") or key == "kernel_scale":
            continue
        scale = tree.get("kernel_scale" if key == "kernel" else f"{key}_scale")
        out[key] = _dequantized(value) if scale is None else dequantize_kernel(value, scale)
    return out


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_experts_give_the_float_model_on_their_dequantized_weights(tmp_path, name):
    model_dir = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2)
    loaded = load_model(str(model_dir), "float32")
    scheme = SCHEMES[name]  # weights only here: the dense layers' products are exact on dequantized weights too
    quantized = quantize_params(loaded.params, scheme)
    experts = quantized["params"]["layers"]["mlp"]["experts"]
    assert experts["gate_proj"].dtype == scheme.weight_jnp_dtype and experts["down_proj_scale"].shape == (2, 7, 64)
    assert quantized["params"]["layers"]["mlp"]["router"]["kernel"].dtype == np.float32
    ours = PagedForward(dataclasses.replace(loaded.config, quantization=scheme), quantized, block_size=4)
    reference = PagedForward(loaded.config, _dequantized(quantized), block_size=4)
    tokens, table = PROMPTS[0], [1, 3, 0, 2]
    chunks = [8, 1, 1, 1]  # 8 tokens x 3 experts sort into groups; single tokens gather their experts' weights
    np.testing.assert_allclose(ours.run(tokens, table, chunks), reference.run(tokens, table, chunks), atol=2e-5,
                               rtol=0)


def test_each_dense_layer_is_quantized_and_nothing_else(loaded):
    scheme = parse_quantization("int8")
    quantized = quantize_params(loaded.params, scheme)["params"]
    layers = quantized["layers"]
    for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        kernel = loaded.params["params"]["layers"]["self_attn"][module]["kernel"]  # [L, in, out]
        leaf = layers["self_attn"][module]
        assert leaf["kernel"].dtype == np.int8 and leaf["kernel"].shape == kernel.shape
        scale = leaf["kernel_scale"]
        assert scale.dtype == np.float32 and scale.shape == kernel.shape[:1] + kernel.shape[2:]
    for module in ("gate_proj", "up_proj", "down_proj"):
        assert layers["mlp"][module]["kernel"].dtype == np.int8
    assert quantized["embed_tokens"]["embedding"].dtype == np.float32
    assert layers["input_layernorm"]["weight"].dtype == np.float32
    assert list(layers["input_layernorm"]) == ["weight"]


def test_a_kernel_is_scaled_per_output_channel():
    kernel = np.array([[1.0, -0.5, 0.0], [-2.0, 0.25, 0.0], [0.5, 0.125, 0.0]], np.float32)  # [in 3, out 3]
    values, scale = quantize_kernel(kernel, parse_quantization("int8"))
    np.testing.assert_array_equal(scale, np.float32([2, 0.5, 127]) / np.float32(127))
    np.testing.assert_array_equal(values, np.array([[64, -127, 0], [-127, 64, 0], [32, 32, 0]], np.int8))
    values, scale = quantize_kernel(kernel, parse_quantization("fp8"))
    assert values.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(scale, np.float32([2, 0.5, 448]) / np.float32(448))
    np.testing.assert_array_equal(values.astype(np.float32)[:, 0], [224, -448, 112])


def test_unknown_schemes_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"^unsupported quantization 'int4'; supported: int8, int8_w8a8, fp8, gguf$"):
        LLM(quantization="int4")
