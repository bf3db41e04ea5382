"""Compare two bench_model.py JSON records (A = the previous code, B = this tree) measured in the same
run: per figure, B / A for throughputs and A / B for step times, so > 1 means B is faster.

    python3 scripts/ab_compare.py A.json B.json [more A.json B.json pairs ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIGURES = {
    "hyserve decode batch 1 (tok/s)": +1,
    "hyserve prefill 8k tokens (tok/s)": +1,
    "hyserve decode step batch 64 (ms)": -1,
    "hyserve prefill 8k tokens, prefix cache on (tok/s)": +1,
    "hyserve warm-up before ready (s)": -1,
}


def values(path: str) -> dict[str, float]:
    return {r["name"]: r["value"] for r in json.loads(Path(path).read_text())["records"]}


def main(argv: list[str]) -> None:
    pairs = [(argv[i], argv[i + 1]) for i in range(0, len(argv) - 1, 2)]
    print("| figure | " + " | ".join(f"A{i} | B{i} | B vs A" for i in range(len(pairs))) + " |")
    print("|---|" + "---|---|---|" * len(pairs))
    for name, sign in FIGURES.items():
        cells = []
        for a_path, b_path in pairs:
            a, b = values(a_path).get(name), values(b_path).get(name)
            if a is None or b is None:
                cells.append("- | - | -")
                continue
            ratio = b / a if sign > 0 else a / b
            cells.append(f"{a:.2f} | {b:.2f} | {ratio:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
