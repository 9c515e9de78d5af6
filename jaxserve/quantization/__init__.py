"""Quantized weights: the engine quantizes the loaded weights (`weights`) and the model's dense layers multiply
through the quantized products (`matmul`); the schemes themselves are
`jaxserve.config.quantization_config.QuantScheme`."""
