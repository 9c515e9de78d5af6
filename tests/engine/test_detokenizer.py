"""The incremental detokenizer decodes through the Rust tokenizer directly only where that gives transformers'
``decode`` text exactly, and its text then equals a whole decode of the output."""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer, rust_decoder
from jaxserve.sampling_params import SamplingParams
from jaxserve.testing.tiny_models import byte_level_tokenizer

# bytes of "Hi, ünï" (multi-byte characters split over tokens), an end-of-sequence token, more bytes
TEXT_IDS = [ord(c) + 3 for c in "Hi, "] + [198, 131] + [198, 179] + [2] + [ord(c) + 3 for c in "ok."]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_rust_decoding_gives_the_tokenizers_text(tokenizer, skip_special_tokens):
    assert rust_decoder(tokenizer) is tokenizer.backend_tokenizer
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, [5, 6], params)
    for token in TEXT_IDS:
        detok.append(token)
    whole = tokenizer.decode([5, 6, *TEXT_IDS], skip_special_tokens=skip_special_tokens)
    assert detok.text == whole[len(tokenizer.decode([5, 6], skip_special_tokens=skip_special_tokens)):]
    assert ("</s>" in detok.text) is not skip_special_tokens


def test_no_rust_decoding_where_transformers_decode_does_more(tokenizer):
    cleaning = byte_level_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    assert rust_decoder(cleaning) is None

    class OwnDecode(type(tokenizer)):
        def decode(self, *args, **kwargs):
            return "own"

    own = byte_level_tokenizer()
    own.__class__ = OwnDecode
    assert rust_decoder(own) is None
    detok = IncrementalDetokenizer(own, [5], SamplingParams())
    detok.append(10)
    assert detok.text == ""  # "own" decodes every window alike: nothing new to show
