"""What the tests and the scripts share: tiny random models and their byte-level tokenizer (`tiny_models`), small
bucket files (`small_buckets`), transformers' reference runs (`hf_reference`), its references of quantized weights
(`quantized_references`) and of quantized KV caches (`rounding_caches`), tiny GGUF files (`tiny_gguf`) and a free
local port (`ports`).

The top layer: it may import anything in the package, and no module of the serving package imports it
(tests/test_architecture.py). The wheel ships it, but it needs the `test` extra (`pip install jaxserve[test]`:
torch for the models and the references); this file imports none of its modules, and those that need torch import
it when called, except `rounding_caches`, whose caches subclass transformers' own."""
