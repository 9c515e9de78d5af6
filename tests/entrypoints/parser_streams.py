"""The streaming harness of the tool call and reasoning parser tests (`test_tool_parsers.py`,
`test_reasoning_parsers.py`): an output fed to a fresh parser piece by piece, as the chat handler feeds it, and
the splits of a text into pieces that the tests stream it in."""

from __future__ import annotations

import random

from jaxserve.entrypoints.openai_protocol import DeltaMessage

PIECE_SIZES = (1, 2, 3, 7)
RANDOM_SPLIT_SEEDS = range(5)


def stream(parser_class: type, pieces: list[str]) -> list[DeltaMessage]:
    """The deltas a fresh `parser_class()` sends for an output that arrives in `pieces`, the last one finishing
    it (any parser with vLLM's `extract_streaming` signature)."""
    parser = parser_class()
    deltas, text = [], ""
    for number, piece in enumerate(pieces):
        previous, text = text, text + piece
        delta = parser.extract_streaming(previous, text, piece, finished=number == len(pieces) - 1)
        if delta is not None:
            deltas.append(delta)
    return deltas


def split_in_pieces(text: str, size: int) -> list[str]:
    """`text` in pieces of `size` characters (the last one shorter); an empty text is one empty piece."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def random_split(text: str, seed: int, most_cuts: int) -> list[str]:
    """`text` cut at 1 to `most_cuts` seeded random places (fewer in a text too short for them)."""
    cuts = []
    if len(text) > 1:
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, most_cuts))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def splits_of(text: str, most_random_cuts: int) -> list[list[str]]:
    """`text` in pieces of each of `PIECE_SIZES`, in a random split per seed of `RANDOM_SPLIT_SEEDS`, and whole."""
    fixed = [split_in_pieces(text, size) for size in PIECE_SIZES]
    return fixed + [random_split(text, seed, most_random_cuts) for seed in RANDOM_SPLIT_SEEDS] + [[text]]


def single_cuts(text: str) -> list[list[str]]:
    """`text` in two pieces, cut at every place inside it."""
    return [[text[:cut], text[cut:]] for cut in range(1, len(text))]
