"""reasoning-gym tasks as prompt data, in one line of a recipe (the reward that scores them: rewards/reasoning_gym.py).

    data:
      train: reasoning_gym:basic_arithmetic?size=2000&seed=1&min_terms=2&max_terms=3
      eval: reasoning_gym:?size=100                      # the same tasks, held out (never a training question)
    rewards:
      - name: reasoning_gym                              # the task's own scorer on the <answer>...</answer> text

    data.train: reasoning_gym:chain_sum*3,basic_arithmetic?size=1000&chain_sum.max_terms=3   # composite, 3:1

The spec: `reasoning_gym:` then the task names (reasoning_gym.factory.DATASETS), comma-separated, each with an
optional `*weight` (several tasks make reasoning-gym's composite dataset, drawn by weight), then an optional query:
`size` (rows, default 1000), `seed` (default 0; a task is the same rows for the same seed), `prompt` (which of
reasoning-gym's SYSTEM_PROMPTS opens each conversation, default `default`; every one asks for the answer between
<answer> tags), `examples` (default 0: how many solved training rows open every conversation, as user / assistant
turns answering `<answer>...</answer>`; a small model follows an example of the format where it ignores the
instruction) and the task's own options (`min_terms=2`; with several tasks `task.option=value`), read as YAML
values.

Held out: an eval spec with no task names takes the training spec's tasks and options. Without a seed of its own the
eval rows start where the training indices end (reasoning-gym draws row i from seed + i, so seed + size is the first
row the training set never drew), and any eval row whose question is also a training question is dropped and
counted, so the two never overlap; it takes the training spec's `prompt` and `examples` unless it gives its own. The
examples are the training spec's first rows, which it then does not ask again. A "+" in the query is a plus sign
(`operators=["+","-"]`), not a URL's space. Each row: `prompt` (the system message, the examples, the question),
`answer` (the reference), `task` (the row's own task, for per-task metrics), and `rg_dataset` / `rg_index`, which the
reward uses to rebuild the row's entry and call that dataset's `score_answer`. Needs the `envs` extra
(pip install 'posttrain[envs]').
"""

from __future__ import annotations

import functools
import json
import logging
import urllib.parse
from dataclasses import dataclass, replace

import datasets
import yaml

from posttrain.errors import UserError, require_package

logger = logging.getLogger(__name__)

PREFIX = "reasoning_gym:"
RESERVED = ("size", "seed", "prompt", "examples")


@dataclass(frozen=True)
class TaskSpec:
    tasks: tuple[tuple[str, float, tuple], ...]
    """(name, weight, sorted (option, value) pairs) per task."""
    size: int = 1000
    seed: int = 0
    prompt: str = "default"
    examples: int = 0
    """Solved rows (the training spec's first ones) shown before each question."""
    given: tuple[str, ...] = ()
    """The query keys of RESERVED the spec gave (a held-out spec takes the others from the training spec)."""

    @property
    def seeded(self) -> bool:
        """The spec gave a seed (else a held-out spec takes its rows after the training ones)."""
        return "seed" in self.given

    def key(self) -> str:
        """A canonical text that rebuilds the same dataset (the rows' `rg_dataset` column)."""
        return json.dumps({"tasks": [[n, w, dict(o)] for n, w, o in self.tasks], "size": self.size,
                           "seed": self.seed}, sort_keys=True)


def is_task_spec(source) -> bool:
    """`reasoning_gym:...` names tasks; anything else (a path, a Path object, None) is data on disk or a hub name."""
    return isinstance(source, str) and source.startswith(PREFIX)


def require_reasoning_gym(what: str):
    return require_package("reasoning_gym", what, "reasoning-gym")


def parse_spec(source: str, what: str) -> TaskSpec:
    """'reasoning_gym:a*2,b?size=..&seed=..&a.option=..' -> TaskSpec; UserError naming `what` when malformed."""
    body = source[len(PREFIX):]
    names, _, query = body.partition("?")
    tasks = []
    for part in filter(None, (p.strip() for p in names.split(","))):
        name, _, weight = part.partition("*")
        try:
            weight_value = float(weight) if weight else 1.0
        except ValueError:
            raise UserError(f"{what}: task '{part}' has weight {weight!r}, not a number ('task*2')") from None
        if not weight_value > 0:
            raise UserError(f"{what}: task '{name}' needs a weight > 0, got {weight}")
        tasks.append([name.strip(), weight_value, {}])
    fields = {"size": 1000, "seed": 0, "prompt": "default", "examples": 0}
    given = []
    # "+" stands for itself (operators=["+","-"]), not for a space as in a URL
    for key, text in urllib.parse.parse_qsl(query.replace("+", "%2B"), keep_blank_values=True, strict_parsing=False):
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = text
        if key in RESERVED:
            fields[key] = value
            given.append(key)
            continue
        task, dot, option = key.rpartition(".")
        owners = [t for t in tasks if t[0] == task] if dot else tasks[:1] if len(tasks) == 1 else []
        if not owners:
            where = f"task '{task}' is not one of {[t[0] for t in tasks]}" if dot else \
                "with several tasks name the task: 'task.option=value'"
            raise UserError(f"{what}: option '{key}' in {source!r}: {where}")
        owners[0][2][option] = value
    for key in ("size", "seed", "examples"):
        if isinstance(fields[key], bool) or not isinstance(fields[key], int) or fields[key] < (key == "size"):
            raise UserError(f"{what}: {key}={fields[key]!r} in {source!r} must be a whole number"
                            f"{' >= 1' if key == 'size' else ' >= 0'}")
    if fields["examples"] > fields["size"]:
        raise UserError(f"{what}: examples={fields['examples']} in {source!r} is more than its size={fields['size']} "
                        "(the examples are the first training rows)")
    return TaskSpec(tuple((n, w, tuple(sorted(o.items()))) for n, w, o in tasks), fields["size"], fields["seed"],
                    str(fields["prompt"]), fields["examples"], tuple(given))


@functools.lru_cache(maxsize=16)
def dataset_from_key(key: str):
    """The reasoning-gym dataset a TaskSpec.key() names (one task's, or the composite of several)."""
    reasoning_gym = require_reasoning_gym("a reasoning_gym: task")
    spec = json.loads(key)
    tasks = spec["tasks"]
    if len(tasks) == 1:
        name, _, options = tasks[0]
        return reasoning_gym.create_dataset(name, size=spec["size"], seed=spec["seed"], **options)
    from reasoning_gym.composite import DatasetSpec

    return reasoning_gym.create_dataset("composite", size=spec["size"], seed=spec["seed"],
                                        datasets=[DatasetSpec(n, w, dict(o)) for n, w, o in tasks])


def build(spec: TaskSpec, what: str):
    """The dataset, or a UserError naming an unknown task (with the closest name) or an option it refuses."""
    require_reasoning_gym(f"{what} (a reasoning_gym: task)")
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    import difflib

    if not spec.tasks:
        raise UserError(f"{what}: name a task after 'reasoning_gym:' (for example reasoning_gym:basic_arithmetic)")
    for name, _, _ in spec.tasks:
        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=1)
            known = ", ".join(sorted(DATASETS)[:8])
            hint = f"did you mean '{close[0]}'?" if close else f"there are {len(DATASETS)}: {known}, ..."
            raise UserError(f"{what}: reasoning-gym has no task '{name}'; {hint}")
    if spec.prompt not in SYSTEM_PROMPTS:
        raise UserError(f"{what}: prompt={spec.prompt!r} is not one of reasoning-gym's system prompts "
                        f"({', '.join(SYSTEM_PROMPTS)})")
    try:
        return dataset_from_key(spec.key())
    except (TypeError, ValueError, AssertionError) as e:  # an unknown option, or a value the task's config refuses
        raise UserError(f"{what}: reasoning-gym refused the options {[dict(o) for _, _, o in spec.tasks]}: "
                        f"{type(e).__name__}: {e}") from None


def task_rows(source: str, what: str, held_out_from: str | None = None) -> datasets.Dataset:
    """The rows of a reasoning_gym: spec (see the module docstring); held_out_from: the training spec, which the
    eval rows never overlap."""
    spec = parse_spec(source, what)
    train = parse_spec(held_out_from, "data.train") if is_task_spec(held_out_from) else None
    if train is not None and not spec.tasks:
        spec = replace(spec, tasks=train.tasks, **{k: getattr(train, k) for k in ("prompt", "examples")
                                                   if k not in spec.given})
    if train is not None and not spec.seeded:
        spec = replace(spec, seed=train.seed + train.size)
    dataset = build(spec, what)
    training = build(train, "data.train") if train is not None else dataset
    from reasoning_gym.utils import SYSTEM_PROMPTS

    seen = {training[i]["question"] for i in range(len(training))} if train is not None else set()
    opening = [{"role": "system", "content": SYSTEM_PROMPTS[spec.prompt]}]
    for i in range(spec.examples):  # training rows, so never a held-out question
        opening += [{"role": "user", "content": training[i]["question"]},
                    {"role": "assistant", "content": f"<answer>{training[i]['answer']}</answer>"}]
    rows, dropped = [], 0
    for i in range(spec.examples if train is None else 0, len(dataset)):  # an example is not asked again
        entry = dataset[i]
        if entry["question"] in seen:
            dropped += 1
            continue
        rows.append({"prompt": opening + [{"role": "user", "content": entry["question"]}],
                     "answer": str(entry["answer"]), "task": entry["metadata"].get("source_dataset", spec.tasks[0][0]),
                     "rg_dataset": spec.key(), "rg_index": i})
    if dropped:
        logger.warning("%s: %d of %d reasoning-gym rows ask a question of the training set and were dropped, so "
                       "the held-out rows never overlap it", what, dropped, len(dataset))
    if not rows:
        raise UserError(f"{what}: every row of {source!r} is also a training question; use a task with more "
                        "distinct questions or other options")
    return datasets.Dataset.from_list(rows)
