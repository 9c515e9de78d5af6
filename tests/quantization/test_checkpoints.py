"""Checkpoints stored quantized in the compressed-tensors format (llm-compressor's, what vLLM serves): read as
stored. A tiny random Llama (and a Qwen3-MoE) written by `write_compressed_tensors` in each scheme loads with its
kernels in the stored type and scales beside them, equal to quantizing the float checkpoint at load; the engine's
greedy tokens on it equal the online-quantized engine's; layers the checkpoint kept in float are quantized as they
load, layers the model keeps in float are dequantized; unsupported configs and a conflicting `quantization` are
refused naming the problem."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.quantization_config import parse_quantization
from jaxserve.quantization.weights import quantize_params
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from jaxserve.weights.compressed_tensors import checkpoint_scheme, quantization_config, write_compressed_tensors

STORED_TYPES = {"int8": np.int8, "int8_w8a8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("float") / "llama", "llama", seed=21)


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("scheme", list(STORED_TYPES))
def test_a_stored_checkpoint_loads_as_quantizing_the_float_one(float_dir, tmp_path, scheme):
    stored_dir = write_compressed_tensors(float_dir, tmp_path / "ct", scheme)
    loaded = load_model(str(stored_dir), "float32")
    assert loaded.config.quantization == parse_quantization(scheme)
    expected = _leaves(quantize_params(load_model(str(float_dir), "float32").params, parse_quantization(scheme)))
    got = _leaves(loaded.params)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    kernel = got["['params']['layers']['self_attn']['q_proj']['kernel']"]
    assert kernel.dtype == STORED_TYPES[scheme] and kernel.shape == (2, 64, 64)  # [layers, in, out]
    assert got["['params']['layers']['self_attn']['q_proj']['kernel_scale']"].shape == (2, 64)


def test_the_engine_serves_a_stored_checkpoint_as_the_online_quantized_one(float_dir, tmp_path):
    stored_dir = write_compressed_tensors(float_dir, tmp_path / "ct", "int8_w8a8")
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 77, 140, 9, 33, 201, 18]}, {"prompt_token_ids": [250, 3, 41]}]
    runs = [dict(model=str(stored_dir)), dict(model=str(stored_dir), quantization="int8_w8a8"),
            dict(model=str(float_dir), quantization="int8_w8a8")]
    tokens = []
    for kwargs in runs:
        llm = LLM(**kwargs, dtype="float32", max_model_len=128, buckets=buckets)
        assert llm.llm_engine.runner.config.quantization.name == "int8_w8a8"
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1] == tokens[2]
    with pytest.raises(ValueError, match=r"^quantization='fp8' was asked for a checkpoint stored as 'int8_w8a8' "
                                         r"\(its quantization_config\): leave it out or give 'int8_w8a8'$"):
        LLM(str(stored_dir), quantization="fp8", dtype="float32", max_model_len=128, buckets=buckets)


def test_quantized_experts_load_as_stored(tmp_path):
    float_dir = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4)
    stored_dir = write_compressed_tensors(float_dir, tmp_path / "ct", "int8")
    got = _leaves(load_model(str(stored_dir), "float32").params)
    expected = _leaves(quantize_params(load_model(str(float_dir), "float32").params, parse_quantization("int8")))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert got["['params']['layers']['mlp']['experts']['gate_proj']"].dtype == np.int8
    assert got["['params']['layers']['mlp']['experts']['gate_proj_scale']"].shape == (2, 7, 48)  # [layers, E, out]
    assert got["['params']['layers']['mlp']['router']['kernel']"].dtype == np.float32


def test_layers_kept_float_or_quantized_against_the_model_are_converted(float_dir, tmp_path):
    """A layer the checkpoint left in float (its ignore list) is quantized as it loads; a quantized LM head (the
    model keeps it in float) is dequantized."""
    from safetensors.numpy import load_file, save_file

    stored_dir = write_compressed_tensors(float_dir, tmp_path / "ct", "int8")
    tensors = load_file(stored_dir / "model.safetensors")
    original = load_file(next(float_dir.glob("*.safetensors")))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = original[name]  # kept in float
    del tensors[name + "_scale"]
    head = original["lm_head.weight"]
    head_scale = np.abs(head).max(axis=1, keepdims=True) / 127
    tensors["lm_head.weight"] = np.round(head / head_scale).astype(np.int8)
    tensors["lm_head.weight_scale"] = head_scale.astype(np.float32)
    save_file(tensors, stored_dir / "model.safetensors")
    got = _leaves(load_model(str(stored_dir), "float32").params)
    expected = _leaves(quantize_params(load_model(str(float_dir), "float32").params, parse_quantization("int8")))
    for leaf in ("kernel", "kernel_scale"):
        key = f"['params']['layers']['mlp']['down_proj']['{leaf}']"
        np.testing.assert_array_equal(got[key], expected[key])
    lm_head = got["['params']['lm_head']['kernel']"]
    assert lm_head.dtype == np.float32
    np.testing.assert_allclose(lm_head, (tensors["lm_head.weight"] * head_scale).T, rtol=1e-6)


def _config_with(**changes) -> dict:
    config = quantization_config(parse_quantization("int8_w8a8"))
    group = config["config_groups"]["group_0"]
    for key, value in changes.items():
        section, _, field = key.partition("__")
        (config if section == "top" else group[section])[field] = value
    return {"quantization_config": config}


def test_the_checkpoint_schemes_read_and_the_unsupported_ones_refused():
    assert checkpoint_scheme({}) is None
    assert checkpoint_scheme(_config_with()) == parse_quantization("int8_w8a8")
    assert checkpoint_scheme({"quantization_config": quantization_config(parse_quantization("int8"))}).name == "int8"
    assert checkpoint_scheme({"quantization_config": quantization_config(parse_quantization("fp8"))}).name == "fp8"
    assert checkpoint_scheme(_config_with(weights__strategy="tensor")).name == "int8_w8a8"
    supported = r"; jaxserve reads int8 \(W8A16\) and int8 W8A8"
    cases = {
        "weights__num_bits": (4, r"weights num_bits=4"),
        "weights__strategy": ("group", r"weights strategy='group'"),
        "weights__symmetric": (False, r"weights symmetric=False"),
        "input_activations__dynamic": (False, r"input_activations dynamic=False"),
        "top__format": ("pack-quantized", r"format must be one of int-quantized, float-quantized"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ValueError, match=rf"^unsupported compressed-tensors scheme \({message}\){supported}"):
            checkpoint_scheme(_config_with(**{key: value}))
    with pytest.raises(ValueError, match=r"^unsupported quantization_config quant_method 'awq': jaxserve reads "
                                         r"compressed-tensors checkpoints"):
        checkpoint_scheme({"quantization_config": {"quant_method": "awq"}})


def test_the_written_config_is_llm_compressors(float_dir, tmp_path):
    stored_dir = write_compressed_tensors(float_dir, tmp_path / "ct", "fp8")
    config = json.loads((stored_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    group = config["config_groups"]["group_0"]
    assert group["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                "dynamic": False, "group_size": None, "observer": "minmax"}
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
    assert config["ignore"] == ["lm_head"]
    assert (stored_dir / "tokenizer.json").is_file()
