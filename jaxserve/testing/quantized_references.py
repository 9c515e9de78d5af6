"""transformers computing what a weight quantization scheme computes (weights replaced by their dequantized values;
where the scheme quantizes activations, each quantized layer's input rounded per token as the scheme does), and the
prompts the quantized models are run on: the references of tests/quantization/test_quantized_models.py and
scripts/check_gpu_quantization.py. transformers and torch (the `test` extra) are imported when called."""

from __future__ import annotations

import numpy as np

from jaxserve.config.quantization_config import QuantScheme
from jaxserve.quantization.weights import QUANTIZED_LINEARS, dequantize_kernel, quantize_kernel

PROMPTS = [[5, 77, 140, 9, 33, 201, 18, 64, 7, 120, 99], [250, 3, 41]]
MAX_TOKENS = 8


def fake_quantized_rows(x, scheme: QuantScheme):
    """x (a torch tensor) with each row rounded to the scheme's activation type and back (vLLM's per-token rule:
    scale = max |row| / 127 for int8, / 448 for float8 e4m3)."""
    import torch

    largest = 127.0 if scheme.weight_dtype == "int8" else 448.0
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / largest, torch.ones_like(absmax))
    if scheme.weight_dtype == "int8":
        return torch.round(x / scale) * scale
    return (x / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def hf_quantized(model_dir, scheme: QuantScheme):
    """transformers' model computing what `scheme` computes: weights dequantized, inputs rounded per token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in QUANTIZED_LINEARS:
            continue
        values, scale = quantize_kernel(module.weight.detach().numpy().T, scheme)  # ours: [in, out]
        module.weight.data = torch.from_numpy(np.ascontiguousarray(dequantize_kernel(values, scale).T))
        if scheme.quantize_activations:
            module.register_forward_pre_hook(lambda _, args: (fake_quantized_rows(args[0], scheme),))
    return model
