"""Every key a recipe takes, with its default and its one-line documentation (the string under each dataclass field).

    for key in recipe_keys(GRPOAlgoConfig):
        print(key.path, key.default, key.doc)       # train.learning_rate 0.0001 Peak learning rate ...

What `posttrain <algo> --help` lists, and where the TRL translation looks for the closest name to an unknown key.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
from dataclasses import dataclass
from typing import Any

from posttrain.config.schema import Recipe
from posttrain.errors import UserError


def recipe_key(f: dataclasses.Field) -> str:
    """A field's key in recipes: its name, or metadata["key"] where the key is a Python keyword."""
    return f.metadata.get("key", f.name)


def set_dotted(raw: dict, key: str, value: Any, what: str) -> None:
    """raw['train']['max_steps'] = value for key 'train.max_steps', adding sections; `what` names it in errors."""
    *parents, leaf = key.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
        if not isinstance(raw, dict):
            raise UserError(f"{what}: '{part}' is a value, not a section")
    raw[leaf] = value


@dataclass(frozen=True)
class RecipeKey:
    path: str
    """Dotted key, as written in an override: train.learning_rate."""
    default: Any
    """The field's default value."""
    doc: str
    """The field's one-line documentation (empty when the field has none)."""


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal under it} for a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (a frozen build): the keys are still listed
        return {}
    body = tree.body[0].body
    return {node.target.id: " ".join(after.value.value.split()) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def recipe_keys(algo_cls: type, cls: type = Recipe, prefix: str = "") -> list[RecipeKey]:
    """Every leaf key of the recipe for one algorithm (its algo: section is `algo_cls`), in declaration order."""
    docs = field_docs(cls)
    keys = []
    for f in dataclasses.fields(cls):
        path = prefix + recipe_key(f)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        inner = algo_cls if cls is Recipe and f.name == "algo" else type(default)
        if dataclasses.is_dataclass(inner):
            keys.extend(recipe_keys(algo_cls, inner, path + "."))
        else:
            keys.append(RecipeKey(path, default, docs.get(f.name, "")))
    return keys


def format_keys(algo_cls: type) -> str:
    """The recipe's keys for --help: `key = default  doc`, one a line, grouped by section."""
    lines = []
    for head, keys in itertools.groupby(recipe_keys(algo_cls), lambda k: k.path.split(".")[0] if "." in k.path else ""):
        lines.append(f"{head}:" if head else "top level:")
        lines += [f"  {k.path} = {k.default!r}" + (f"  # {k.doc}" if k.doc else "") for k in keys]
    return "\n".join(lines)
