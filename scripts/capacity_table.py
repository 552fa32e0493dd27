#!/usr/bin/env python3
"""The README's capacity table from a sweep's verdict: `make capacity` prints it.

Reads OUT/verdict.json (the settings, each trace's capacities and each setting's worst fraction
of its trace's best) and prints a Markdown table: a row per trace, a column per setting in the
order run, the best on each trace in bold, the time budget's capacity over the best token
budget's, and the worst fraction of each setting.

Usage: capacity_table.py OUT
"""

import json
import sys
from pathlib import Path

# Shorter names for the bundled traces; any other trace keeps its file's name.
NAMES = {
    "AzureLLMInferenceTrace_conv.csv": "Azure conv",
    "AzureLLMInferenceTrace_code.csv": "Azure code",
    "mooncake_fast25_synthetic_trace.head2000.jsonl": "Mooncake",
}


def label(setting: str) -> str:
    return setting if setting.endswith(" ms") or setting == "off" else f"{setting} tok"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    path = Path(sys.argv[1]) / "verdict.json"
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"capacity_table: cannot read {path}: {e}", file=sys.stderr)
        return 1
    traces = verdict["traces"]
    settings = [p["setting"] for p in traces[0]["settings"]]
    header = ["trace"] + [label(s) for s in settings] + ["time ÷ best tokens"]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for t in traces:
        caps = {p["setting"]: p["capacity"] for p in t["settings"]}
        best = max(caps.values())
        cells = []
        for s in settings:
            c = caps.get(s)
            text = "-" if c is None else f"{c:.3f}×"
            cells.append(f"**{text}**" if c is not None and c == best and best > 0 else text)
        ratio = t.get("time_over_tokens")
        cells.append("-" if ratio is None else f"{ratio:.2f}")
        print(f"| {NAMES.get(t['trace'], t['trace'])} | " + " | ".join(cells) + " |")
    worst = {r["setting"]: r["worst"] for r in verdict["settings"]}
    top = max((w for w in worst.values() if w is not None), default=None)
    cells = []
    for s in settings:
        w = worst.get(s)
        text = "-" if w is None else f"{w:.2f}"
        cells.append(f"**{text}**" if w is not None and w == top else text)
    print("| worst ÷ trace's best | " + " | ".join(cells) + " | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
