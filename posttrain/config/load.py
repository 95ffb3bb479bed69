"""YAML + dotted overrides -> a validated, frozen `Recipe`.

    recipe = load_recipe("recipes/sft.yaml", ["train.max_steps=20", "model.name_or_path=tiny/"], SFTAlgoConfig)

Unknown keys fail with the closest valid name; values are checked against the field's type and range.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from posttrain.config.keys import recipe_key, set_dotted
from posttrain.config.legacy import upgrade
from posttrain.config.schema import Recipe
from posttrain.config.trl_compat import (eval_every_logging_step, flat_trl_keys, from_trl_file,
                                          trl_default_settings, trl_paths)
from posttrain.config.validate import validate
from posttrain.errors import UserError


def load_recipe(path: str | None, overrides: list[str], algo_cls: type) -> Recipe:
    """Read a recipe file (optional), apply `key.sub=value` overrides, build and validate the dataclasses."""
    return resolve_recipe(path, overrides, algo_cls)[0]


def resolve_recipe(path: str | None, overrides: list[str], algo_cls: type,
                   trl_flags: dict | None = None) -> tuple[Recipe, list[tuple[str, str, Any]]]:
    """load_recipe, and the TRL defaults it took: a run given in TRL's words (`trl_flags`: the TRL flags of a command
    line with no posttrain recipe file, already among `overrides`; or a file with flat TRL keys) takes TRL's default
    for every recipe key it leaves out, as [(TRL key, recipe key, value)] (docs/trl.md); a posttrain recipe keeps
    posttrain's."""
    raw: dict[str, Any] = {}
    where = "defaults"
    flat: dict = dict(trl_flags or {})
    in_trl_words = bool(flat) and not path
    if path:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"recipe file {path} does not exist; pass --config with a YAML recipe (see recipes/)")
        try:
            raw = parse_yaml(p.read_text(), f"recipe {path}") or {}
        except yaml.YAMLError as e:
            raise UserError(f"recipe {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise UserError(f"recipe {path} must be a mapping of sections (model:, data:, train:, ...)")
        where = str(path)
        flat.update(flat_trl_keys(raw))
        in_trl_words = bool(flat_trl_keys(raw))
        raw = from_trl_file(raw, where, algo_cls)  # a TRL config's flat keys (model_name_or_path, ...) into sections
    for item in overrides:
        apply_override(raw, item)
    taken = []
    if in_trl_words:
        engine = raw.get("generation", {}).get("engine") if isinstance(raw.get("generation"), dict) else None
        given = set(dotted_paths(raw)) | trl_paths(flat)  # a TRL key given as false or `steps` sets nothing, yet chose
        taken = trl_default_settings(algo_cls, given, use_vllm=engine in ("vllm", "server"))
        for _, key, value in taken:
            set_dotted(raw, key, value, f"TRL's default for '{key}'")
    eval_every_logging_step(flat, raw, where if path else "command line")
    upgrade(raw)  # earlier releases' spellings (config/legacy.py)
    raw.setdefault("algo", {})  # the command's own algo config, with its defaults, even without an algo: section
    recipe = build(Recipe, raw, where, "", algo_cls)
    if recipe.output_dir.startswith("~"):  # `output_dir=~/x` reaches us unexpanded (no shell does it after '=')
        recipe = dataclasses.replace(recipe, output_dir=str(Path(recipe.output_dir).expanduser()))
    validate(recipe)
    return recipe, taken


def dotted_paths(raw: dict, prefix: str = "") -> list[str]:
    """Every key a raw recipe mapping sets, dotted (train.learning_rate), sections included."""
    out = []
    for key, value in raw.items():
        out.append(prefix + str(key))
        if isinstance(value, dict):
            out += dotted_paths(value, f"{prefix}{key}.")
    return out


def apply_override(raw: dict, item: str) -> None:
    """`train.max_steps=20` -> raw['train']['max_steps'] = 20 (the value parsed as YAML, so 1e-4, true, null work)."""
    if "=" not in item:
        raise UserError(f"override '{item}' must look like key.sub=value (for example train.max_steps=20)")
    key, _, value = item.partition("=")
    try:
        parsed = parse_yaml(value, f"override '{item}'", key.strip()) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    set_dotted(raw, key.strip(), parsed, f"override '{item}'")


MAX_ALIASED_VALUES = 10_000  # values YAML aliases may add to a recipe beyond those written out


def parse_yaml(text: str, where: str, key: str = "") -> Any:
    """yaml.safe_load, refusing what safe_load accepts silently: a key given twice in one mapping (the last would
    win), aliases that expand to more than MAX_ALIASED_VALUES values (a "billion laughs" recipe: loading is quick,
    everything that walks it afterwards runs for ever), an alias inside itself, and nesting Python cannot follow.
    `key`: the dotted key the text is the value of (an override's), so messages name the whole key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        _check_nodes(node, where, key)
        loader = yaml.SafeLoader("")
        try:
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except RecursionError:
        raise UserError(f"{where} is nested too deeply to read; a recipe needs a few levels of sections") from None


def _check_nodes(root: yaml.Node, where: str, key: str) -> None:
    """Duplicate keys (with the dotted key and both lines) and the values aliases add, counted without expanding."""
    sizes: dict[int, int] = {}  # id(node) -> values under it, aliases expanded
    open_nodes: set[int] = set()
    aliased = 0

    def size(node: yaml.Node, path: str) -> int:
        nonlocal aliased
        node_id = id(node)
        if node_id in open_nodes:
            raise UserError(f"{where} line {node.start_mark.line + 1}: '{path}' is an alias inside its own anchor; "
                            "write the value out")
        if node_id in sizes:  # a second use of an anchored node: an alias
            aliased += sizes[node_id]
            if aliased > MAX_ALIASED_VALUES:
                raise UserError(f"{where} line {node.start_mark.line + 1}: aliases (*name) expand '{path}' and the "
                                f"values before it to more than {MAX_ALIASED_VALUES:,} values; write the values out "
                                "or use fewer aliases")
            return sizes[node_id]
        open_nodes.add(node_id)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                name = str(k.value) if isinstance(k, yaml.ScalarNode) else f"<{k.tag}>"
                child = f"{path}.{name}" if path else name
                if name in seen and name != "<<":  # `<<: *base` merges; its keys may be overridden on purpose
                    raise UserError(f"{where} line {k.start_mark.line + 1}: key '{child}' is given twice (first on "
                                    f"line {seen[name]}); YAML would keep only the last: keep one")
                seen[name] = k.start_mark.line + 1
                total += size(k, child) + size(v, child)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(v, f"{path}[{i}]") for i, v in enumerate(node.value))
        open_nodes.discard(node_id)
        sizes[node_id] = total
        return total

    size(root, key)


def build(cls: type, raw: Any, where: str, prefix: str, algo_cls: type | None = None) -> Any:
    """Recursively turn a mapping into the dataclass `cls`, checking keys and types."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise UserError(f"{where}: '{prefix.rstrip('.') or 'recipe'}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {recipe_key(f): f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key).rsplit(".", 1)[-1], list(fields), n=1, cutoff=0.5)
            hint = (f"; did you mean '{prefix}{close[0]}'?" if close
                    else f"; valid keys here: {', '.join(sorted(fields))}")
            raise UserError(f"{where}: unknown key '{prefix}{key}'{hint}")
    kwargs = {fields[key]: build(algo_cls, value, where, "algo.") if cls is Recipe and fields[key] == "algo"
              else coerce(hints[fields[key]], value, where, prefix + key) for key, value in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise UserError(f"{where}: section '{prefix.rstrip('.')}': {e}") from None


def coerce(hint: Any, value: Any, where: str, key: str) -> Any:
    """Check (and gently convert) one value against its annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, bool) and bool in args:  # a switch with words beside true / false (auto)
            return value
        others = [a for a in args if a is not type(None)]
        return coerce(next((a for a in others if a is not bool), others[0]), value, where, key)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where, key + ".")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: '{key}' must be a list, got {value!r}")
        item_type = args[0] if args else Any
        return tuple(coerce(item_type, v, where, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{where}: '{key}' must be true or false, got {value!r}")
    if hint is int:
        if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer()):
            return int(value)
        raise UserError(f"{where}: '{key}' must be an integer, got {value!r}")
    if hint is float:
        try:  # a number, or text YAML did not read as one (1e-4)
            if not isinstance(value, bool) and isinstance(value, (int, float, str)):
                return float(value)
        except ValueError:
            pass
        raise UserError(f"{where}: '{key}' must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, bool) or value is None:
            # YAML reads unquoted no/yes/off as booleans: a classic trap for mixed_precision: no
            words = {True: "yes, on or true as true", False: "no, off or false as false", None: "null or ~ as null"}
            raise UserError(f"{where}: '{key}' must be a string, got {value!r}: YAML reads a bare "
                            f"{words[value]}; quote the word you meant, e.g. {key.rsplit('.', 1)[-1]}: 'no'")
        return str(value)
    return value


def to_dict(obj: Any) -> Any:
    """A recipe as plain data (for config.yaml)."""
    if dataclasses.is_dataclass(obj):
        return {recipe_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)
