"""repetitive_edits.jsonl: 48 chat requests whose answers copy most of their prompt, for speculative decoding.

N-gram speculation (prompt lookup) proposes the tokens that followed the last few generated tokens where they
occur earlier in the context; it pays when the output repeats the input: repeating or rewriting a given text,
editing code. This workload is that case, in three tasks of 16 requests each:

- `repeat`: "Repeat the following text exactly, word for word:" and a paragraph of plain English prose (one of
  8, about 560 characters, or two of them run together into one paragraph). Expected answer: the text.
- `rewrite`: "Copy the following text word for word, but fix the spelling mistakes:" and such a paragraph with 3 to
  6 typos (two letters swapped, a letter dropped or a letter doubled, in words of 5 letters or more).
  Expected answer: the text without the typos.
- `code_edit`: "Output this Python function again, exactly as it is, except that the variable `a` is renamed to
  `b`:" and a small Python function (one of 8, 10 to 13 lines) in a ```python fenced block. Expected answer:
  the fenced function with `a` renamed (whole words; `a` is a local variable or parameter that occurs nowhere
  else in the function).

One request a line: `{"id", "task", "messages": [{"role": "user", "content": ...}], "output_len"}`, ids 0-47 in
the order repeat, rewrite, code_edit. Messages only (no system message), so the file fits any chat model:
render them with the model's chat template, add_generation_prompt=True. `output_len` is a little more than the
expected answer: its characters over 4.5 for prose and over 3.5 for code (about SmolLM2's tokens), times 1.2,
rounded, clamped to [64, 384]. Benchmarks that need every engine to do the same work generate exactly
`output_len` tokens (`ignore_eos=True`; past the answer the continuation is the model's own, not a copy);
otherwise let the model stop at its end of sequence.

With SmolLM2-135M-Instruct (the embedded model; its ChatML template adds a default system prompt) the prompts
are 144 to 298 tokens (median 174; repeat 155-291, rewrite 163-298, code_edit 144-214), the expected answers
88 to 249 tokens and `output_len` 1.08 to 1.42 times them (106 to 306). Greedy, it does copy: the share of its
output 4-grams (of tokens) found in the prompt is 0.94 for repeat, 0.89 for rewrite and 0.92 for code_edit
(over each task's tokens; at least 0.8 in 14, 14 and 13 of the 16 requests), and it stops by itself after
about 0.78 of `output_len`. It often leaves the typos or the old name in place; a copy is what counts here.
The phrasing was chosen for that: with "Rewrite the following text, fixing the spelling mistakes and changing
nothing else" or "Rename the variable ... and output the whole function", or two paragraphs separated by a
blank line, the 135M model summarizes, rewrites the code or stops after the first paragraph far more often.

Everything is built from text embedded in this script (8 paragraphs, 8 functions), combined with a fixed seed
by a small generator of its own (`Rng`), so that the file is byte-identical on every run and Python version.

    python scripts/make_repetitive_workload.py                  # writes ../shared/workloads/repetitive_edits.jsonl
    python scripts/make_repetitive_workload.py --out FILE       # elsewhere
    python scripts/make_repetitive_workload.py --describe       # prints this description
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

SEED = 20250611
NUM_PER_TASK = 16
DEFAULT_OUT = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "repetitive_edits.jsonl"

PARAGRAPHS = [
    "The old lighthouse on the northern cape was built in 1872 from granite blocks carried by boat from a quarry "
    "across the bay. For almost a century a keeper lived in the small house at its base, climbing the spiral "
    "stairs every evening to light the lamp and every morning to put it out. The last keeper left in 1965, when "
    "the light was made automatic, and the house stood empty for many years. Today a group of volunteers looks "
    "after the building. They repaint the tower every few summers, guide visitors up the stairs on weekends, and "
    "keep a logbook of the ships that pass the cape.",
    "Baking bread at home takes more patience than skill. Flour, water, salt and yeast are mixed into a rough "
    "dough, which is then kneaded until it feels smooth and springs back when pressed. The dough rests in a warm "
    "place until it has doubled in size, which can take an hour or most of an afternoon, depending on the "
    "temperature of the kitchen. After that it is shaped into a loaf, left to rise a second time, and baked in a "
    "hot oven until the crust is deep brown and the bottom sounds hollow when tapped. The hardest part is waiting "
    "for the loaf to cool before cutting it.",
    "Every weekday morning the first train leaves the valley station at ten past six. It is usually quiet at that "
    "hour: a few nurses going to the hospital in town, students with heavy bags, and workers from the bakery who "
    "have already been awake for hours. The train follows the river for most of the journey, passing orchards, a "
    "paper mill and a long row of gardens. In winter the windows are dark until the last stop, but in summer the "
    "sun rises over the hills just as the train crosses the iron bridge, and many of the passengers look up from "
    "their phones to watch it.",
    "The town library moved into the former post office last spring. The building needed new wiring, a lift and "
    "a great deal of paint, but the high windows and the wooden counters were kept. Children's books now fill the "
    "old sorting room, and the manager's office has become a quiet reading room with six desks and a view of the "
    "square. The library lends more than books: visitors can borrow tools, board games, a sewing machine and even "
    "a telescope. On Thursday evenings a volunteer helps older residents with their phones and computers, and the "
    "sessions are nearly always full.",
    "Honey bees share the location of food through a movement known as the waggle dance. A forager returning to "
    "the hive walks in a straight line while shaking her body, then circles back and repeats the pattern. The "
    "angle of the straight run shows the direction of the flowers relative to the sun, and the length of the run "
    "tells how far away they are. Other bees follow the dancer closely, learn the route, and fly out to find the "
    "flowers themselves. Because the sun moves across the sky during the day, the bees slowly change the angle of "
    "their dance as the hours pass.",
    "Tomatoes grow best in a sunny spot with rich soil and regular water. Seeds are usually started indoors about "
    "six weeks before the last frost and moved outside once the nights are warm. Tall varieties need a stake or a "
    "cage, because the stems become heavy with fruit by the middle of summer. Watering deeply twice a week is "
    "better than a little every day, since it helps the roots grow down into the soil. Leaves that touch the "
    "ground should be removed to keep diseases away, and the fruit tastes best when it is picked fully ripe and "
    "eaten the same day.",
    "Thank you all for coming to the planning meeting on Tuesday. We agreed that the new website will go live at "
    "the start of next month, after one more round of testing. Maria will finish the contact form and check that "
    "messages reach the shared inbox. Tom will move the old news articles and fix any broken links he finds. The "
    "photos for the team page still need to be taken, so please tell Anna which mornings you are free next week. "
    "If anything on this list is wrong or missing, reply to this message before Friday so that we can update the "
    "plan.",
    "Fixing a flat bicycle tire is a simple job once you have done it a few times. First remove the wheel and let "
    "out any air that is left in the tube. Use two tire levers to lift one side of the tire over the rim, then "
    "pull the tube out and pump a little air into it to find the hole. A small hole can be closed with a patch, "
    "but a long cut means the tube should be replaced. Before putting everything back, run your fingers carefully "
    "around the inside of the tire to find the thorn or piece of glass that caused the puncture.",
]

# Each function with two of its variables to rename (old, new): names that occur only as that variable.
FUNCTIONS = [
    (
        '''def summarize_scores(scores):
    if not scores:
        return None
    count = len(scores)
    total = sum(scores)
    ordered = sorted(scores)
    middle = count // 2
    if count % 2 == 1:
        median = ordered[middle]
    else:
        median = (ordered[middle - 1] + ordered[middle]) / 2
    spread = max(scores) - min(scores)
    return {"count": count, "mean": total / count, "median": median, "spread": spread}''',
        [("ordered", "sorted_scores"), ("total", "score_sum")],
    ),
    (
        '''def count_words(text, min_length=1):
    counts = {}
    for line in text.splitlines():
        for word in line.lower().split():
            word = word.strip(".,;:!?()")
            if len(word) < min_length:
                continue
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked''',
        [("counts", "frequencies"), ("word", "token")],
    ),
    (
        '''def binary_search(items, target):
    low = 0
    high = len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1''',
        [("middle", "mid"), ("low", "left")],
    ),
    (
        '''def read_csv_rows(path, delimiter=","):
    rows = []
    with open(path) as handle:
        header = handle.readline().strip().split(delimiter)
        for line in handle:
            line = line.strip()
            if not line:
                continue
            fields = line.split(delimiter)
            if len(fields) != len(header):
                raise ValueError(f"bad row: {line}")
            rows.append(dict(zip(header, fields)))
    return rows''',
        [("handle", "csv_file"), ("fields", "values")],
    ),
    (
        '''def merge_intervals(intervals):
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]''',
        [("merged", "result"), ("last", "previous")],
    ),
    (
        '''def fetch_with_retries(fetch, url, attempts=3, delay=0.5):
    last_error = None
    for attempt in range(1, attempts + 1):
        try:
            return fetch(url)
        except OSError as error:
            last_error = error
            if attempt == attempts:
                break
            wait = delay * 2 ** (attempt - 1)
            time.sleep(wait)
    raise RuntimeError(f"giving up on {url}") from last_error''',
        [("last_error", "previous_error"), ("wait", "pause")],
    ),
    (
        '''def format_table(rows, headers):
    widths = [len(header) for header in headers]
    for row in rows:
        for column, cell in enumerate(row):
            widths[column] = max(widths[column], len(str(cell)))
    lines = []
    lines.append(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    lines.append("-+-".join("-" * w for w in widths))
    for row in rows:
        lines.append(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    return "\\n".join(lines)''',
        [("widths", "column_widths"), ("lines", "output")],
    ),
    (
        '''def validate_user(user):
    errors = []
    name = user.get("name", "").strip()
    if not name:
        errors.append("a name is required")
    email = user.get("email", "")
    if "@" not in email:
        errors.append("the email address is not valid")
    age = user.get("age")
    if age is not None and (age < 0 or age > 150):
        errors.append("the age is out of range")
    return errors''',
        [("errors", "problems"), ("user", "account")],
    ),
]

REPEAT = "Repeat the following text exactly, word for word:\n\n{text}"
REWRITE = "Copy the following text word for word, but fix the spelling mistakes:\n\n{text}"
CODE_EDIT = (
    "Output this Python function again, exactly as it is, except that the variable `{old}` is renamed to `{new}`:"
    "\n\n{code}"
)


class Rng:
    """A tiny seeded generator (splitmix64), so that the choices never depend on the Python version (the
    standard library guarantees `random.random()`'s sequence across versions, not `shuffle` or `sample`)."""

    def __init__(self, seed: int):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next64() % n  # the bias is far below anything a workload of 48 requests could show

    def randint(self, low: int, high: int) -> int:
        return low + self.below(high - low + 1)

    def shuffle(self, items: list) -> None:
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]

    def sample(self, n: int, k: int) -> list[int]:
        """k distinct integers from range(n)."""
        pool = list(range(n))
        self.shuffle(pool)
        return pool[:k]


def output_len(answer: str, chars_per_token: float) -> int:
    return max(64, min(384, round(len(answer) / chars_per_token * 1.2)))


def texts(rng: Rng) -> list[str]:
    """16 texts, in a seeded order: the 8 paragraphs alone and 8 pairs of different ones run together."""
    order = list(range(len(PARAGRAPHS)))
    rng.shuffle(order)
    singles = [PARAGRAPHS[i] for i in order]
    pairs = [PARAGRAPHS[order[i]] + " " + PARAGRAPHS[order[(i + 3) % len(order)]] for i in range(len(order))]
    chosen = singles + pairs
    rng.shuffle(chosen)
    return chosen[:NUM_PER_TASK]


def add_typo(word: str, kind: int) -> str:
    """`word` with one typo: two interior letters swapped (0), a letter dropped (1) or doubled (2)."""
    i = 1 + (len(word) - 3) // 2  # an interior position, never the first or last letter
    if kind == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if kind == 1:
        return word[:i] + word[i + 1 :]
    return word[:i] + word[i] + word[i:]


def with_typos(text: str, rng: Rng) -> str:
    """`text` with 3 to 6 typos, in distinct words of at least 5 letters chosen by `rng`."""
    spans = [m.span() for m in re.finditer(r"[A-Za-z]{5,}", text)]
    picked = sorted(rng.sample(len(spans), rng.randint(3, 6)))
    out, end = [], 0
    for n, j in enumerate(picked):
        start, stop = spans[j]
        word = text[start:stop]
        kind = (n + j) % 3
        typo = add_typo(word, kind)
        if typo == word:  # swapping or a double letter that changed nothing: drop a letter instead
            typo = add_typo(word, 1)
        out.append(text[end:start] + typo)
        end = stop
    out.append(text[end:])
    return "".join(out)


def rename(code: str, old: str, new: str) -> str:
    assert re.search(rf"\b{old}\b", code), (old, code[:40])
    return re.sub(rf"\b{old}\b", new, code)


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def build() -> list[dict]:
    """The requests, each with its expected answer under "_answer"; ids in the order repeat, rewrite, code_edit."""
    rng = Rng(SEED)
    rows = []
    for text in texts(rng):
        rows.append(("repeat", REPEAT.format(text=text), text, 4.5))
    for text in texts(rng):
        rows.append(("rewrite", REWRITE.format(text=with_typos(text, rng)), text, 4.5))
    edits = [(code, old, new) for code, names in FUNCTIONS for old, new in names]
    rng.shuffle(edits)
    for code, old, new in edits[:NUM_PER_TASK]:
        prompt = CODE_EDIT.format(old=old, new=new, code=fenced(code))
        rows.append(("code_edit", prompt, fenced(rename(code, old, new)), 3.5))
    return [
        {
            "id": i,
            "task": task,
            "messages": [{"role": "user", "content": prompt}],
            "output_len": output_len(answer, chars_per_token),
            "_answer": answer,
        }
        for i, (task, prompt, answer, chars_per_token) in enumerate(rows)
    ]


def requests() -> list[dict]:
    """The workload's requests, as written to the file."""
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in build()]


def expected_answers() -> dict[int, str]:
    """Each request's expected answer by id (not written to the file; for checks of a model's outputs)."""
    return {row["id"]: row["_answer"] for row in build()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write (default: %(default)s)")
    parser.add_argument("--describe", action="store_true", help="print the workload's description and exit")
    args = parser.parse_args()
    if args.describe:
        print(__doc__)
        return
    rows = requests()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    counts = {task: sum(row["task"] == task for row in rows) for task in ("repeat", "rewrite", "code_edit")}
    print(f"wrote {len(rows)} requests {counts} to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
