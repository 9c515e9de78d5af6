"""compressed-tensors checkpoints written by the compressed-tensors library itself (what llm-compressor uses to save),
not by jaxserve's own writer: a tiny random Llama quantized by the library in each scheme jaxserve reads (int8 W8A8,
float8 e4m3 FP8_DYNAMIC, int8 weight-only per channel written "int-quantized"), its weight scales from the library's
`calculate_qparams` on each output channel's min and max (llm-compressor's min-max observer), compressed by
`ModelCompressor` and saved with `save_pretrained`. jaxserve's logits on it equal transformers' loading the same
directory (the library decompresses the weights) within test_quantized_models' tolerance, and the engine's greedy
tokens equal transformers' generate. The weight-only int schemes in the format the library infers for them
("pack-quantized": int8 W8A16 as llm-compressor saves it by default, and W4A16), which jaxserve does not read, are
refused naming it.

One difference is by design: the library rounds int8 activations per token with scale max|x| / 127.5 (its int8
range -128..127), vLLM's kernels and jaxserve with max|x| / 127 (8 tokens of this model: logits 0.25 apart), so the
int8 W8A8 reference rounds its activations as vLLM does. Float8 activations are rounded alike (max|x| / 448)."""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    disable_quantization,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams

from jaxserve import LLM, SamplingParams
from jaxserve.config.quantization_config import QuantScheme
from jaxserve.testing.hf_reference import greedy_continuation
from jaxserve.testing.quantized_references import MAX_TOKENS, PROMPTS, fake_quantized_rows
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from tests.forward import PagedForward

INT8_CHANNEL_WEIGHTS = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)
# the library's scheme -> (jaxserve's scheme name, the stored weights' type)
SCHEMES = {
    "W8A8": ("int8_w8a8", np.int8),
    "FP8_DYNAMIC": ("fp8", ml_dtypes.float8_e4m3fn),
    "W8A16_CHANNEL": ("int8", np.int8),  # the library's W8A16 preset is grouped (128): per channel, as vLLM reads
}
# the format the library is asked to write (None: the one it infers); weight-only int8 it would pack into int32
# words ("pack-quantized", which jaxserve refuses: the last test), so it is asked for "int-quantized"
FORMATS = {"W8A8": None, "FP8_DYNAMIC": None, "W8A16_CHANNEL": "int-quantized"}


def library_scheme(name: str, targets: list[str]) -> QuantizationScheme:
    if name == "W8A16_CHANNEL":
        return QuantizationScheme(targets=targets, weights=INT8_CHANNEL_WEIGHTS)
    if name == "W4A16_GROUP32":  # the W4A16 preset with groups that divide the tiny model's 64 inputs
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
        return QuantizationScheme(targets=targets, weights=weights)
    return preset_name_to_scheme(name, targets)


def write_with_library(float_dir: Path, out: Path, scheme_name: str, quantization_format: str | None = None) -> Path:
    """``float_dir`` quantized by the compressed-tensors library and saved in ``out`` as llm-compressor saves it: the
    config applied to every Linear but the LM head, each weight's scales from its own min and max, compressed in
    ``quantization_format`` (None: the format the library infers)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    config = QuantizationConfig(config_groups={"group_0": library_scheme(scheme_name, ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _observe_weight(module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for file in float_dir.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and not (out / file.name).exists():
            shutil.copy(file, out / file.name)  # the tokenizer
    return out


def _observe_weight(module: torch.nn.Module) -> None:
    """The weight's scale (and zero point) by the library's `calculate_qparams` on its min and max over each
    quantization group: an output channel, or a group of inputs in it."""
    args = module.quantization_scheme.weights
    weight = module.weight.detach()
    if args.strategy == "group":
        weight = weight.reshape(weight.shape[0], -1, args.group_size)
    scale, zero_point = calculate_qparams(weight.amin(-1), weight.amax(-1), args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def transformers_as_served(model_dir: Path, served: QuantScheme):
    """transformers loading ``model_dir`` (the library decompresses its weights), each quantized layer's input rounded
    as jaxserve rounds it under ``served``: the library's own rounding where it is vLLM's (float8), vLLM's per-token
    rule for int8 (the library's divides by 127.5), none where the scheme leaves activations in float."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.input_activations is None:
            continue
        if served.quantize_activations and scheme.input_activations.type == "float":
            continue
        disable_quantization(module)  # the weights are decompressed already: this only stops its activation rounding
        if served.quantize_activations:
            module.register_forward_pre_hook(lambda _, args: (fake_quantized_rows(args[0], served),))
    return model


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("float") / "llama", "llama", seed=21)


@pytest.fixture(scope="module")
def library_dirs(float_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("library")
    return {name: write_with_library(float_dir, out / name, name, FORMATS[name]) for name in SCHEMES}


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_logits_equal_transformers_loading_the_same_directory(library_dirs, scheme_name):
    name, stored_type = SCHEMES[scheme_name]
    loaded = load_model(str(library_dirs[scheme_name]), "float32")
    assert loaded.config.quantization.name == name
    assert loaded.params["params"]["layers"]["mlp"]["down_proj"]["kernel"].dtype == stored_type
    forward = PagedForward(loaded.config, loaded.params, block_size=4)  # fp8: float8 activations, as the library's
    ours = forward.run(PROMPTS[0], block_table=[3, 0, 2, 1], chunks=[5, 4, 1, 1])
    with torch.no_grad():
        reference = transformers_as_served(library_dirs[scheme_name], loaded.config.quantization)
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_engine_greedy_tokens_equal_transformers_generate(library_dirs, tmp_path, scheme_name):
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,))
    llm = LLM(str(library_dirs[scheme_name]), dtype="float32", max_model_len=128, buckets=buckets)
    served = llm.llm_engine.runner.config.quantization  # on this CPU, fp8 leaves activations in float
    assert served.name == SCHEMES[scheme_name][0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    reference = transformers_as_served(library_dirs[scheme_name], served)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy_continuation(reference, p, MAX_TOKENS)
                                                         for p in PROMPTS]


@pytest.mark.parametrize("scheme_name", ["W8A16_CHANNEL", "W4A16_GROUP32"])
def test_a_pack_quantized_checkpoint_is_refused_naming_its_format(float_dir, tmp_path, scheme_name):
    """Weight-only int schemes in the format the library infers for them: values packed into int32 words."""
    model_dir = write_with_library(float_dir, tmp_path / scheme_name, scheme_name)
    with pytest.raises(ValueError, match=r"^unsupported compressed-tensors scheme \(format must be one of "
                                         r"int-quantized, float-quantized\); jaxserve reads int8 \(W8A16\)"):
        load_model(str(model_dir), "float32")
