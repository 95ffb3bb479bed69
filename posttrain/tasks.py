"""The synthetic arithmetic task used by the demo, the example recipes and the tests: addition asked and answered in
chat, with a checkable answer. Every dataset form the recipes need is written from the same generator.

    python -m posttrain.tasks examples/data     # (re)writes the shipped example data
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def arithmetic_problems(n: int, seed: int, max_operand: int = 99, exclude: set | None = None,
                        max_addend: int | None = None) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs with a <= max_operand and b <= max_addend (default max_operand), avoiding the pairs in
    `exclude` (so held-out sets never overlap training)."""
    max_addend = max_operand if max_addend is None else max_addend
    rng = random.Random(seed)
    seen = set(exclude or ())
    if n > (max_operand + 1) * (max_addend + 1) - len(seen):
        raise ValueError(f"only {(max_operand + 1) * (max_addend + 1) - len(seen)} distinct problems left, asked for {n}")
    out = []
    while len(out) < n:
        pair = (rng.randint(0, max_operand), rng.randint(0, max_addend))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A plausible wrong sum: off by one in a digit, so preference pairs are about correctness, not format."""
    right = a + b
    for _ in range(10):
        candidate = right + rng.choice([-10, -1, 1, 10, 2, -2])
        if candidate >= 0 and candidate != right:
            return candidate
    return right + 1


def sft_rows(problems) -> list[dict]:
    """Conversational prompt-completion rows."""
    return [
        {"prompt": [{"role": "user", "content": question(a, b)}],
         "completion": [{"role": "assistant", "content": str(a + b)}],
         "answer": str(a + b)}
        for a, b in problems
    ]


def preference_rows(problems, seed: int) -> list[dict]:
    """Conversational preference rows with explicit prompt: the correct sum preferred to a wrong one."""
    rng = random.Random(seed)
    return [
        {"prompt": [{"role": "user", "content": question(a, b)}],
         "chosen": [{"role": "assistant", "content": str(a + b)}],
         "rejected": [{"role": "assistant", "content": str(wrong_answer(a, b, rng))}]}
        for a, b in problems
    ]


def prompt_rows(problems) -> list[dict]:
    """Conversational prompt-only rows with the answer column the exact-match reward reads."""
    return [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)} for a, b in problems]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_example_data(out: str | Path, n_train: int = 2000, n_eval: int = 200, seed: int = 0,
                       max_addend: int | None = None) -> dict[str, Path]:
    out = Path(out)
    held_out = arithmetic_problems(n_eval, seed + 1, max_addend=max_addend)
    train = arithmetic_problems(n_train, seed, exclude=set(held_out), max_addend=max_addend)
    return {
        "sft_train": write_jsonl(sft_rows(train), out / "sft_train.jsonl"),
        "sft_eval": write_jsonl(sft_rows(held_out), out / "sft_eval.jsonl"),
        "pref_train": write_jsonl(preference_rows(train, seed), out / "pref_train.jsonl"),
        "pref_eval": write_jsonl(preference_rows(held_out, seed + 1), out / "pref_eval.jsonl"),
        "prompts_train": write_jsonl(prompt_rows(train), out / "prompts_train.jsonl"),
        "prompts_eval": write_jsonl(prompt_rows(held_out), out / "prompts_eval.jsonl"),
    }


if __name__ == "__main__":
    for name, path in write_example_data(sys.argv[1] if len(sys.argv) > 1 else "examples/data").items():
        print(f"{name}: {path}")
