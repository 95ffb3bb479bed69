"""The synthetic arithmetic task used by the demo, the example recipes and the tests: addition asked and answered in
chat, with a checkable answer. Every dataset form the recipes need is written from the same generator.

    python -m posttrain.demo.tasks examples/data     # (re)writes the shipped example data
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


def carries(a: int, b: int) -> bool:
    """Whether adding the ones digits carries into the tens."""
    return a % 10 + b % 10 >= 10


def forgot_carry(a: int, b: int) -> int:
    """The sum written with the carry into the tens forgotten (57 + 8 -> 55): the classic slip."""
    return a + b - 10 if carries(a, b) else a + b


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A plausible wrong sum: the forgotten carry where the problem carries, otherwise off by a little in one digit, so
    preference pairs are about correctness, not format."""
    if carries(a, b):
        return forgot_carry(a, b)
    right = a + b
    for _ in range(10):
        candidate = right + rng.choice([-10, -1, 1, 10, 2, -2])
        if candidate >= 0 and candidate != right:
            return candidate
    return right + 1


def sft_rows(problems, carry_slip: float = 0.0, seed: int = 0) -> list[dict]:
    """Conversational prompt-completion rows. `carry_slip`: the share of carrying problems whose demonstrated answer
    forgets the carry, as a sloppy demonstrator would (the `answer` column always holds the true sum)."""
    rng = random.Random(seed)
    rows = []
    for a, b in problems:
        shown = forgot_carry(a, b) if carries(a, b) and rng.random() < carry_slip else a + b
        rows.append({"prompt": [{"role": "user", "content": question(a, b)}],
                     "completion": [{"role": "assistant", "content": str(shown)}],
                     "answer": str(a + b)})
    return rows


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
                       max_operand: int = 99, max_addend: int | None = None, n_rl: int = 0,
                       carry_slip: float = 0.0) -> dict[str, Path]:
    """The task's files under `out`: sft_*, pref_*, prompts_* (train and held-out eval). With `n_rl` > 0 the
    preference and prompt training files use n_rl further problems that SFT never saw (as when post-training asks new
    questions), otherwise the SFT problems. `carry_slip` makes the SFT demonstrations sloppy (see sft_rows)."""
    out = Path(out)
    held_out = arithmetic_problems(n_eval, seed + 1, max_operand, max_addend=max_addend)
    problems = arithmetic_problems(n_train + n_rl, seed, max_operand, exclude=set(held_out), max_addend=max_addend)
    train, later = problems[:n_train], (problems[n_train:] if n_rl else problems[:n_train])
    return {
        "sft_train": write_jsonl(sft_rows(train, carry_slip, seed), out / "sft_train.jsonl"),
        "sft_eval": write_jsonl(sft_rows(held_out), out / "sft_eval.jsonl"),
        "pref_train": write_jsonl(preference_rows(later, seed), out / "pref_train.jsonl"),
        "pref_eval": write_jsonl(preference_rows(held_out, seed + 1), out / "pref_eval.jsonl"),
        "prompts_train": write_jsonl(prompt_rows(later), out / "prompts_train.jsonl"),
        "prompts_eval": write_jsonl(prompt_rows(held_out), out / "prompts_eval.jsonl"),
    }


if __name__ == "__main__":
    for name, path in write_example_data(sys.argv[1] if len(sys.argv) > 1 else "examples/data").items():
        print(f"{name}: {path}")
