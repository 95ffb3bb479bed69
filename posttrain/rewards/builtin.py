"""Built-in reward functions, picked by name in the recipe.

They follow TRL's contract (posttrain/rewards/contract.py): called by keyword with `completions` (strings, or message
lists for conversational data: the rules read the last assistant message), the dataset's columns and the rest of
the contract in **kwargs; one value per completion. A recipe's `kwargs` are bound with functools.partial. None means
"no reward for this sample" (counted, and left out of the total).

    rewards:
      - name: exact_match                  # 1.0 when the final answer equals the `answer` column
      - name: format
        kwargs: {pattern: '<think>.*</think>\\s*<answer>.*</answer>'}
        weight: 0.2
      - name: length_penalty
        kwargs: {target_length: 200, max_length: 400}
      - name: reward_model
        kwargs: {path: runs/rm/final}
      - name: overlong                     # DAPO's soft overlong punishment (rewards/overlong.py)
        kwargs: {max_length: 512, buffer: 128}
      - name: judge                        # an LLM judge on an OpenAI-compatible endpoint (rewards/judge.py)
        kwargs: {url: 'http://127.0.0.1:8000/v1', prompt_template: judge.jinja}

overlong and judge are classes on TRL's keyword contract (prompts=, completions=, completion_ids=, **columns), built
once from their kwargs.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
from typing import Any, Callable, Optional

from posttrain.errors import UserError, overflows_float32
from posttrain.rewards.contract import CONTRACT_ARGS, column_values, completion_text
from posttrain.rewards.math_answers import MathAccuracy, require_math_verify, think_answer_format
from posttrain.rewards import reasoning_gym as rg_reward, verifiers_rubric
from posttrain.rewards.judge import Judge
from posttrain.rewards.overlong import Overlong
from posttrain.rewards.reward_model import load_scorer, reward_model

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_ANSWER_PREFIX = re.compile(r"answer\s*:", re.IGNORECASE)


def _boxed(text: str) -> Optional[str]:
    """Contents of the last \\boxed{...}, with nested braces; None when there is none (or it is unclosed)."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _after_last(text: str, marker: re.Pattern | str) -> Optional[str]:
    """The rest of the line after the last occurrence of `marker`; None when it does not occur."""
    if isinstance(marker, str):  # rfind: the last occurrence, overlapping ones too ('######')
        at = text.rfind(marker)
        end = at + len(marker) if at >= 0 else None
    else:
        found = list(marker.finditer(text))
        end = found[-1].end() if found else None
    return None if end is None else text[end:].strip().split("\n", 1)[0]


def _marked_answer(text: str) -> Optional[str]:
    """An explicitly marked answer: \\boxed{x}, then '#### x', then 'Answer: x'."""
    found = (_boxed(text), _after_last(text, "####"), _after_last(text, _ANSWER_PREFIX))
    return next((answer for answer in found if answer is not None), None)


def extract_answer(text: str) -> str:
    """The final answer in a completion: a marked answer (\\boxed{}, ####, Answer:), else the last number, else all."""
    marked = _marked_answer(text)
    if marked is not None:
        return marked.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def _normalise(answer: str) -> str:
    return " ".join(answer.split()).strip().strip("$").strip().rstrip(".").strip().casefold()


def _as_number(answer: str) -> Optional[float]:
    cleaned = answer.lstrip("$")
    return float(cleaned.replace(",", "")) if _NUMBER.fullmatch(cleaned) else None


def answers_match(completion: str, reference: Any) -> bool:
    """Does the completion's final answer equal the reference (numbers by value, text case- and space-insensitively)?"""
    reference_text = str(reference)
    target = _normalise(_marked_answer(reference_text) or reference_text)
    candidate = _normalise(extract_answer(completion))
    target_number = _as_number(target)
    if target_number is None:
        return candidate == target
    candidate_number = _as_number(candidate)
    if candidate_number is None:  # 'Answer: 42 apples' against 42
        numbers = _NUMBER.findall(candidate)
        candidate_number = _as_number(numbers[0]) if numbers else None
    return candidate_number is not None and math.isclose(candidate_number, target_number, rel_tol=1e-9, abs_tol=1e-9)


def exact_match(completions: list, answer_column: str = "answer", **kwargs) -> list[Optional[float]]:
    """1.0 when the completion's final answer equals the reference in `answer_column`, else 0.0 (None: no reference).

    The completion's final answer is the last \\boxed{...}, else the text after the last '####', else after the last
    'Answer:', else the last number, else the whole text. A reference written the same ways (GSM8K's '... #### 72')
    is reduced to its marked answer. Numbers compare by value ('1,000' == '1000.0'); text ignores case, spaces,
    surrounding '$' and a final '.'.
    """
    references = column_values(kwargs, answer_column, "exact_match")
    return [None if reference is None else float(answers_match(completion_text(completion), reference))
            for completion, reference in zip(completions, references)]


def format_reward(completions: list, pattern: str, fullmatch: bool = True, **kwargs) -> list[float]:
    """1.0 when the completion matches the regex `pattern` (re.DOTALL), else 0.0; the whole of it (fullmatch=True) or
    anywhere in it (re.search)."""
    regex = re.compile(pattern, re.DOTALL)
    match = regex.fullmatch if fullmatch else regex.search
    return [float(match(completion_text(completion)) is not None) for completion in completions]


@functools.lru_cache(maxsize=4)
def _tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def length_penalty(completions: list, max_length: int, target_length: int = 0, unit: str = "chars",
                   tokenizer: Optional[str] = None, completion_ids: Optional[list] = None, **kwargs) -> list[float]:
    """A penalty in [-1, 0] for completions longer than `target_length`, reaching -1 at `max_length` (DAPO's soft
    overlong punishment, Yu et al. 2025):

        penalty(L) = 0                                         if L <= target_length
                   = -(L - target_length) / (max_length - target_length)   if target_length < L < max_length
                   = -1                                        if L >= max_length

    L counts characters of the completion's text (unit=chars) or tokens (unit=tokens): the generated
    `completion_ids`, else the text re-encoded with `tokenizer` (a tokenizer directory or hub id).
    """
    texts = [completion_text(c) for c in completions]
    if unit == "tokens":
        if completion_ids is not None:
            lengths = [len(ids) for ids in completion_ids]
        elif tokenizer is not None:
            encode = _tokenizer(tokenizer)
            lengths = [len(encode(t, add_special_tokens=False)["input_ids"]) for t in texts]
        else:
            raise UserError("reward length_penalty with unit=tokens needs kwargs.tokenizer (a tokenizer path or hub id)")
    else:
        lengths = [len(t) for t in texts]
    span = max_length - target_length
    return [-min(1.0, max(0, length - target_length) / span) for length in lengths]


BUILTIN_REWARDS: dict[str, Callable[..., list]] = {"exact_match": exact_match, "format": format_reward,
                                                   "length_penalty": length_penalty, "reward_model": reward_model,
                                                   "overlong": Overlong, "judge": Judge, "math_accuracy": MathAccuracy,
                                                   "think_answer_format": think_answer_format,
                                                   "reasoning_gym": rg_reward.reasoning_gym,
                                                   "verifiers": verifiers_rubric.verifiers}
"""A function gets the recipe's kwargs bound; a class is built once with them (its __init__ checks them)."""


def _check_format(kwargs: dict) -> None:
    try:
        re.compile(kwargs["pattern"], re.DOTALL)
    except (re.error, TypeError) as e:
        raise UserError(f"reward format: kwargs.pattern {kwargs['pattern']!r} is not a valid regular expression: "
                        f"{e}") from None


def _check_length_penalty(kwargs: dict) -> None:
    target, most, unit = kwargs.get("target_length", 0), kwargs["max_length"], kwargs.get("unit", "chars")
    if not (isinstance(most, int) and isinstance(target, int) and 0 <= target < most):
        raise UserError("reward length_penalty: need integers 0 <= kwargs.target_length < kwargs.max_length, "
                        f"got {target} and {most}")
    if unit not in ("chars", "tokens"):
        raise UserError(f"reward length_penalty: kwargs.unit must be chars or tokens, got {unit!r}")
    if unit == "tokens" and kwargs.get("tokenizer"):
        _tokenizer(kwargs["tokenizer"])


CHECKS: dict[str, Callable[[dict], None]] = {  # reward_model loads now: a bad path fails before any compute
    "format": _check_format, "length_penalty": _check_length_penalty, "reward_model": lambda kw: load_scorer(**kw),
    "math_accuracy": lambda kw: require_math_verify("reward math_accuracy"), "reasoning_gym": rg_reward.check,
    "verifiers": verifiers_rubric.check}


def check_builtin_kwargs(name: str, kwargs: dict) -> None:
    """Fail at start-up on unknown or missing kwargs of a built-in reward, and on bad values."""
    params = inspect.signature(BUILTIN_REWARDS[name]).parameters.values()
    named = {p.name: p for p in params if p.kind is not p.VAR_KEYWORD and p.name not in CONTRACT_ARGS}
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, list(named), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; it takes {', '.join(named) or 'none'}"
            raise UserError(f"reward {name}: unknown kwarg '{key}'{hint}")
    missing = [n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise UserError(f"reward {name} needs kwargs {', '.join(missing)} (in the recipe: rewards[].kwargs)")
    for key, value in kwargs.items():  # each ends up in a float32 reward: inf (or 1e39, inf there) zeroes advantages
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                not math.isfinite(value) or overflows_float32(value)):
            raise UserError(f"reward {name}: kwargs.{key} is {value:.3g}, which is not a finite float32 (the dtype "
                            "rewards are computed in, largest 3.4e+38); give a smaller number")
    if name in CHECKS:
        CHECKS[name](kwargs)
