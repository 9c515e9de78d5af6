"""A horizontal bar chart as a standalone SVG (no plotting library needed), for docs/benchmarks/.

    python scripts/plot_bars.py docs/benchmarks/cpu_bf16_offline.svg "output tok/s, 128 requests" \\
        "jaxserve auto (bfloat16)=250" "vLLM CPU bfloat16=180"
"""

from __future__ import annotations

import argparse
from html import escape
from pathlib import Path

WIDTH, LABEL_WIDTH, BAR_HEIGHT, GAP, TOP = 720, 240, 26, 10, 40
COLORS = ("#3b6fb6", "#d9822b", "#7a9c3c", "#9b59b6", "#888888")


def bar_chart_svg(title: str, bars: list[tuple[str, float]]) -> str:
    """An SVG with one labelled bar per (label, value), scaled to the largest value."""
    largest = max(value for _, value in bars) or 1.0
    span = WIDTH - LABEL_WIDTH - 80
    height = TOP + len(bars) * (BAR_HEIGHT + GAP) + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
        f'font-size="13">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="24" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (label, value) in enumerate(bars):
        y = TOP + i * (BAR_HEIGHT + GAP)
        length = span * value / largest
        parts += [
            f'<text x="{LABEL_WIDTH - 8}" y="{y + 18}" text-anchor="end">{escape(label)}</text>',
            f'<rect x="{LABEL_WIDTH}" y="{y}" width="{length:.1f}" height="{BAR_HEIGHT}" '
            f'fill="{COLORS[i % len(COLORS)]}"/>',
            f'<text x="{LABEL_WIDTH + length + 6:.1f}" y="{y + 18}">{value:g}</text>',
        ]
    return "\n".join([*parts, "</svg>", ""])


def parse_bar(text: str) -> tuple[str, float]:
    label, sep, value = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=VALUE, got {text!r}")
    return label, float(value)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("title")
    parser.add_argument("bars", nargs="+", type=parse_bar, metavar="LABEL=VALUE")
    args = parser.parse_args(argv)
    args.output.write_text(bar_chart_svg(args.title, args.bars))


if __name__ == "__main__":
    main()
