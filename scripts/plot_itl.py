"""Inter-token latency over time as a standalone SVG (no plotting library needed), for docs/benchmarks/.

Reads the JSON results `vllm bench serve --save-result --save-detailed` writes (per request: `start_times`,
`ttfts`, `itls`, in seconds), places every inter-token gap of every request at the time its token arrived,
and draws per result, for each second of the run, the largest gap (solid) and the mean gap (dashed) of the
tokens that arrived in it, on a log scale; the legend gives the whole run's mean and P99 ITL.
`scripts/bench_serving.py --servers ...` writes this plot for the servers it measured.

    python scripts/plot_itl.py docs/benchmarks/itl_over_time.svg "ITL over time" jaxserve=results/jaxserve.json \\
        vllm=results/vllm.json
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path

import numpy as np

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 860, 420, 70, 170, 40, 50
COLORS = ("#3b6fb6", "#d9822b", "#7a9c3c", "#9b59b6", "#888888")


def itl_points(result: dict) -> tuple[np.ndarray, np.ndarray]:
    """(seconds since the first request was sent, ITL in ms) of every token after each request's first."""
    start = min(result["start_times"])
    times, gaps = [], []
    for sent, ttft, itls in zip(result["start_times"], result["ttfts"], result["itls"], strict=True):
        arrivals = sent + ttft + np.cumsum(itls)
        times.append(arrivals - start)
        gaps.append(np.asarray(itls) * 1000.0)
    return np.concatenate(times or [np.zeros(0)]), np.concatenate(gaps or [np.zeros(0)])


def _log_ticks(low: float, high: float) -> list[float]:
    ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5)]
    return [t for t in ticks if low <= t <= high]


def per_second(times: np.ndarray, gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(second, largest gap, mean gap) of every second of the run in which some token arrived."""
    seconds = np.floor(times).astype(int)
    kept = np.unique(seconds)
    largest = np.array([gaps[seconds == s].max() for s in kept])
    mean = np.array([gaps[seconds == s].mean() for s in kept])
    return kept + 0.5, largest, mean


def itl_svg(title: str, series: list[tuple[str, np.ndarray, np.ndarray]]) -> str:
    """An SVG of each named series' per-second largest (solid) and mean (dashed) ITL over time, y log scale."""
    all_gaps = np.concatenate([g for _, _, g in series])
    low, high = max(float(all_gaps.min()), 1.0) / 1.5, float(all_gaps.max()) * 1.5
    t_max = max(float(np.ceil(t.max())) for _, t, _ in series if t.size) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x = lambda t: LEFT + plot_w * t / t_max
    y = lambda ms: TOP + plot_h * (1 - (math.log10(max(ms, low)) - math.log10(low)) / (math.log10(high / low)))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        f'font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">seconds since the first request '
        "(per second: largest ITL solid, mean ITL dashed)</text>",
        f'<text x="16" y="{TOP + plot_h / 2}" transform="rotate(-90 16 {TOP + plot_h / 2})" text-anchor="middle">'
        "inter-token latency, ms (log)</text>",
    ]
    for tick in _log_ticks(low, high):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for tick in np.linspace(0, t_max, 6):
        parts.append(f'<text x="{x(tick):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{tick:.0f}</text>')
    for i, (name, times, gaps) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        seconds, largest, mean = per_second(times, gaps)
        for values, dash in ((largest, ""), (mean, ' stroke-dasharray="5 3"')):
            points = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in zip(seconds, values, strict=True))
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"{dash}/>')
        legend_y = TOP + 14 + 46 * i
        parts += [
            f'<rect x="{WIDTH - RIGHT + 12}" y="{legend_y - 9}" width="9" height="9" fill="{color}"/>',
            f'<text x="{WIDTH - RIGHT + 26}" y="{legend_y}">{escape(name)}</text>',
            f'<text x="{WIDTH - RIGHT + 26}" y="{legend_y + 16}">mean {gaps.mean():.0f} ms, '
            f"P99 {np.percentile(gaps, 99):.0f} ms</text>",
        ]
    return "\n".join([*parts, "</svg>", ""])


def write_itl_plot(path: Path, title: str, results: list[tuple[str, dict]]) -> None:
    series = [(name, *itl_points(result)) for name, result in results]
    Path(path).write_text(itl_svg(title, series))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the SVG file to write")
    parser.add_argument("title")
    parser.add_argument("results", nargs="+", help="NAME=PATH of a `vllm bench serve` JSON result")
    args = parser.parse_args()
    results = []
    for item in args.results:
        name, sep, path = item.partition("=")
        if not sep:
            parser.error(f"expected NAME=PATH, got {item!r}")
        results.append((name, json.loads(Path(path).read_text())))
    write_itl_plot(Path(args.output), args.title, results)


if __name__ == "__main__":
    main()
