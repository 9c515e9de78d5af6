"""Chat messages -> prompt text through the tokenizer's Jinja chat template (or one passed in).

`LLM.chat` renders each conversation here and tokenizes the text without adding special tokens (the
template writes them itself, e.g. the BOS token), as vLLM's chat entrypoints do. `load_chat_template` reads
the server's `--chat-template` (a file or the template itself), for models that ship none (GGUF files often).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path

Conversation = Sequence[dict]


def is_batch_of_conversations(messages) -> bool:
    """`LLM.chat` takes one conversation (a list of message dicts) or a list of conversations."""
    return bool(messages) and isinstance(messages[0], (list, tuple))


def render_chat(
    tokenizer,
    conversation: Conversation,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template and none was given: pass chat_template= (a Jinja "
            "template string) to use chat"
        )
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be True: pass "
            "add_generation_prompt=False to continue the final message"
        )
    if not conversation:
        raise ValueError("a conversation needs at least one message")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"each chat message must be a dict with a 'role', got {message!r}")
    return tokenizer.apply_chat_template(
        list(conversation), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tokenize=False,
    )


JINJA_MARKERS = "{}\n"  # a value with any of these is a template, not a path


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` as vLLM reads it: the text of the file it names, else the value itself when it looks
    like a Jinja template (its escapes such as \\n decoded), else a ValueError naming the unreadable path."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except OSError as err:
        if not any(marker in value for marker in JINJA_MARKERS):
            raise ValueError(
                f"the chat template {value!r} looks like a file path, but it could not be read ({err.strerror})"
            ) from err
    return codecs.decode(value, "unicode_escape")
