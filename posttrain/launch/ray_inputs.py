"""What the Ray driver hands its actors, made to mean the same on every node: the recipe's paths resolved once, in
the driver's working directory, and only the environment a worker needs.

    recipe = absolute_paths(recipe)         # runs/rm/final -> /home/me/project/runs/rm/final, once, in the driver
    env = worker_env(os.environ, recipe)    # ACCELERATE_*, OMP_*, HF caches ...; secrets only where the run needs them

A relative path in a recipe means "from where I ran the command". Actors run in Ray's own working directory (a rank
worker's, a role replica's, an engine's, on whatever node), so every string in the recipe that names an existing file
or directory here (a model, data, a reward file, a teacher, the output directory) is made absolute before anything
is shipped. On a cluster the paths must be on storage every node mounts at the same place, as for torchrun.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

from posttrain.config.schema import Recipe, trackers

# the driver's environment the workers get (Ray starts them from the raylet's environment, not the driver's)
FORWARDED_PREFIXES = ("HF_", "HUGGINGFACE_", "TOKENIZERS_", "OMP_", "MKL_", "TORCH_", "ACCELERATE_", "FSDP_",
                      "TRANSFORMERS_", "POSTTRAIN_", "NCCL_", "GLOO_", "WANDB_", "MLFLOW_", "TRACKIO_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
HUB_TOKENS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN")
TRACKER_SECRETS = {"wandb": ("WANDB_API_KEY",), "mlflow": ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD"),
                   "trackio": ("HF_TOKEN",)}


def _local_path(value: str, base: Path) -> str:
    """`value` made absolute when it names an existing file or directory relative to `base` (a reward's
    'file.py:function' too); anything else (hub ids, words, absolute paths) unchanged."""
    if not value or os.path.isabs(value) or "\n" in value:
        return value
    reward_file = value.count(":") == 1 and not value.startswith("http")  # 'file.py:function'
    head, colon, tail = value.partition(":") if reward_file else (value, "", "")
    return str((base / head).resolve()) + colon + tail if (base / head).exists() else value


def _walk(value: Any, base: Path) -> Any:
    if isinstance(value, str):
        return _local_path(value, base)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _walk(getattr(value, f.name), base)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, Mapping):
        return {k: _walk(v, base) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, base) for v in value)
    return value


def absolute_paths(recipe: Recipe, base: str | Path | None = None) -> Recipe:
    """The recipe with every string naming an existing path under `base` (the driver's working directory) made
    absolute, and output_dir absolute whether it exists yet or not."""
    root = Path(base or os.getcwd())
    resolved = _walk(recipe, root)
    out = Path(recipe.output_dir).expanduser()
    return dataclasses.replace(resolved, output_dir=str(out if out.is_absolute() else (root / out).resolve()))


def _hub_ids(recipe: Recipe) -> bool:
    """The recipe names a model or dataset that is not a local path (a worker may download it)."""
    names = [recipe.model.name_or_path, recipe.data.train, recipe.data.eval,
             *(getattr(recipe.algo, f, None) for f in ("critic_model_name_or_path", "teacher_model_name_or_path"))]
    return any(isinstance(n, str) and n and not os.path.isabs(n) and not Path(n).exists() for n in names)


def worker_env(environ: Mapping[str, str], recipe: Recipe) -> dict[str, str]:
    """The variables the workers get: the launcher's, the engines', the caches' and the trackers' settings; a secret
    (a name with TOKEN, KEY, SECRET or PASSWORD in it) only where the run needs it: the hub token when the recipe
    names something on the hub, a tracker's key when the recipe reports to it (rank 0 logs)."""
    needed = set()
    if recipe.generation.placement == "servers" or getattr(recipe.algo, "teacher_server", None):
        needed.add("POSTTRAIN_SERVER_TOKEN")  # the servers' token (engines the launcher starts bring their own)
    if _hub_ids(recipe):
        needed.update(HUB_TOKENS)
    for name in trackers(recipe.train):
        needed.update(TRACKER_SECRETS.get(name, ()))
    return {key: value for key, value in environ.items() if key.startswith(FORWARDED_PREFIXES)
            and (key in needed or not any(word in key for word in SECRET_WORDS))}
