"""Summarise a `py-spy record -f raw` file: samples per root and the inclusive share of each function.

A root is the thread, or with --subprocesses the process (the server and its engine process).

python3 scripts/pyspy_summary.py /tmp/pyspy_all.txt [--top 40]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.raw) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack or not n.isdigit():
                continue
            count = int(n)
            total += count
            frames = stack.split(";")
            threads[frames[0]] += count
            for fr in dict.fromkeys(frames):  # each function once per sample
                inclusive[fr] += count
    if total == 0:
        raise SystemExit(f"no samples in {args.raw}")
    print(f"{total} samples")
    for name, n in threads.most_common(5):
        print(f"thread root {100 * n / total:5.1f}%  {name}")
    for name, n in inclusive.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
