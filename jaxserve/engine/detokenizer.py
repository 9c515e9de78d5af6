"""Incremental detokenization and stop checks, on the host after each step.

Text grows by decoding a short window of the latest token ids (the prefix/read offsets of vLLM), so
each step costs O(1) in the output length and multi-byte characters are only emitted once complete.
Stop strings are searched in the tail of the text where a new match can appear, so a stop string that
spans token boundaries is caught. While a request streams, the last `len(longest stop) - 1` characters
are held back (`visible_text`): they may still turn out to be the start of a stop string (vLLM does the
same).
"""

from __future__ import annotations

import functools

from jaxserve.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs, for correct leading spaces


@functools.cache
def _decodes_in_rust_only(tokenizer_class: type) -> bool:
    """Whether a tokenizer class's ``decode`` is transformers' fast one unchanged: the Rust tokenizer's decode, then
    an optional clean-up of spaces (nothing else: `spaces_between_special_tokens` is the slow tokenizers')."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (issubclass(tokenizer_class, PreTrainedTokenizerFast)
            and tokenizer_class.decode is PreTrainedTokenizerBase.decode
            and tokenizer_class._decode is PreTrainedTokenizerFast._decode)


def rust_decoder(tokenizer):
    """The Rust tokenizer of ``tokenizer`` where decoding through it directly gives ``tokenizer.decode``'s text (a
    fast tokenizer that overrides no decoding and cleans up no spaces), else None. transformers' decode first walks
    the ids in Python (`to_py_obj`): on a GPU a sixth of the engine's host time per step (docs/benchmarks/gpu.md)."""
    if not _decodes_in_rust_only(type(tokenizer)) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.rust_tokenizer = rust_decoder(tokenizer)
        self.params = params
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        if self.rust_tokenizer is not None:
            return self.rust_tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def visible_text(self, finished: bool) -> str:
        """The text to report: all of it once finished, else without the held-back tail."""
        held_back = 0 if finished else self.params.output_text_buffer_length
        return self.text[: len(self.text) - held_back] if held_back else self.text

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Adds one generated token; returns the stop string it completed, if any (text is then cut).

        `check_stop` is False while fewer than min_tokens tokens exist (stop strings do not count then)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete multi-byte character or nothing visible yet
        previous_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._check_stop(previous_len) if check_stop else None

    def _check_stop(self, previous_len: int) -> str | None:
        if not self.params.stop:
            return None
        search_from = max(0, previous_len - self.max_stop_len + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.text = self.text[:end]
        return stop
