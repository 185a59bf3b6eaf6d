"""Print a few input prompts beside their completions (used by `make demo`).

Usage: python -m bench.show INPUT.jsonl OUTPUT.jsonl [N]
"""

from __future__ import annotations

import sys

import orjson


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    outputs = {}
    with open(out, "rb") as f:
        for line in f:
            row = orjson.loads(line)
            outputs[row["id"]] = row
    with open(src, "rb") as f:
        for line in f:
            row = orjson.loads(line)
            if row["id"] not in outputs:
                continue
            done = outputs[row["id"]]
            print(
                f"--- {row['id']} ({done['prompt_tokens']} prompt tokens, "
                f"{done['completion_tokens']} completion tokens, {done['finish_reason']})"
            )
            print("prompt:    ", row["prompt"][:200].replace("\n", " "))
            print("completion:", done["completion"][:400].replace("\n", " "))
            n -= 1
            if n == 0:
                break


if __name__ == "__main__":
    main()
