"""Mean TTFT and P99 ITL against request rate, one line per server, as a standalone SVG (no plotting library).

`scripts/bench_serving.py --servers ... --request-rates ...` writes this plot from its sweep: two panels side
by side, log-scaled milliseconds, the rates evenly spaced on the x axis ("inf" = all at once last).

    python scripts/plot_load_sweep.py out.svg "title" sweep.json    # the sweep's saved rows
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path

PANEL_WIDTH, HEIGHT, LEFT, TOP, BOTTOM, GAP, LEGEND = 380, 360, 60, 50, 50, 50, 240
COLORS = ("#3b6fb6", "#d9822b", "#7a9c3c", "#9b59b6", "#888888")
PANELS = (("mean_ttft_ms", "mean TTFT (ms)"), ("p99_itl_ms", "P99 ITL (ms)"))


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _log_ticks(low: float, high: float) -> list[float]:
    ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5)]
    return [t for t in ticks if low <= t <= high]


def sweep_svg(title: str, rows: list[dict], panels=PANELS, x_label: str = "requests/s") -> str:
    """rows: {"server", "rate", "mean_ttft_ms", "p99_itl_ms", ...}, one per server and rate; ``panels``: (metric,
    label) of the two panels; the x axis is the rows' "rate", labelled ``x_label``."""
    rates = sorted({r["rate"] for r in rows})
    servers = list(dict.fromkeys(r["server"] for r in rows))
    width = LEFT + 2 * PANEL_WIDTH + GAP + LEGEND
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{HEIGHT}" font-family="sans-serif" '
             f'font-size="12">', f'<rect width="{width}" height="{HEIGHT}" fill="white"/>',
             f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>']
    for p, (metric, label) in enumerate(panels):
        x0 = LEFT + p * (PANEL_WIDTH + GAP)
        parts += _panel(x0, metric, label, rows, rates, servers, x_label)
    for i, server in enumerate(servers):
        y = TOP + 20 + 20 * i
        x = LEFT + 2 * PANEL_WIDTH + GAP + 10
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{COLORS[i % len(COLORS)]}" '
                     f'stroke-width="2"/><text x="{x + 26}" y="{y + 4}">{escape(server)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(x0: int, metric: str, label: str, rows: list[dict], rates: list[float], servers: list[str],
           x_label: str) -> list[str]:
    values = [max(r[metric], 1e-3) for r in rows]
    low, high = 10 ** math.floor(math.log10(min(values))), 10 ** math.ceil(math.log10(max(values)))
    plot_h = HEIGHT - TOP - BOTTOM
    to_y = lambda v: TOP + plot_h * (1 - (math.log10(max(v, 1e-3)) - math.log10(low)) / math.log10(high / low))
    to_x = lambda i: x0 + PANEL_WIDTH * (i + 0.5) / len(rates)
    parts = [f'<text x="{x0}" y="{TOP - 10}" font-weight="bold">{escape(label)}</text>',
             f'<rect x="{x0}" y="{TOP}" width="{PANEL_WIDTH}" height="{plot_h}" fill="none" stroke="#999"/>']
    for tick in _log_ticks(low, high):
        y = to_y(tick)
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_WIDTH}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for i, rate in enumerate(rates):
        parts.append(f'<text x="{to_x(i):.1f}" y="{HEIGHT - BOTTOM + 18}" text-anchor="middle">'
                     f'{rate_label(rate)}</text>')
    parts.append(f'<text x="{x0 + PANEL_WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle">{escape(x_label)}</text>')
    for s, server in enumerate(servers):
        by_rate = {r["rate"]: r[metric] for r in rows if r["server"] == server}
        points = [(to_x(i), to_y(by_rate[rate])) for i, rate in enumerate(rates) if rate in by_rate]
        color = COLORS[s % len(COLORS)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in points]
    return parts


def write_sweep_plot(path: Path, title: str, rows: list[dict], panels=PANELS, x_label: str = "requests/s") -> None:
    path.write_text(sweep_svg(title, rows, panels, x_label))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output")
    parser.add_argument("title")
    parser.add_argument("rows", help="JSON list of rows (bench_serving.py writes sweep.json)")
    args = parser.parse_args()
    write_sweep_plot(Path(args.output), args.title, json.loads(Path(args.rows).read_text()))


if __name__ == "__main__":
    main()
