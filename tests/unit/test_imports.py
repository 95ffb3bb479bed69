"""STYLE rule 5: only posttrain/distributed/ imports distributed machinery (ray included), only posttrain/rollout/ vLLM.

Every module outside posttrain/distributed/ is read (the pure layers ops/, losses/, algorithms/, rewards/, config/
included) for torch.distributed, accelerate and deepspeed, and outside posttrain/rollout/ for vllm. This reads the
source with ast (nothing is imported), so it also covers imports inside functions.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
PURE_PACKAGES = ("ops", "losses", "algorithms", "rewards", "config")
FORBIDDEN = ("torch.distributed", "accelerate", "deepspeed", "ray", "vllm")
ALLOWED_IN = {"distributed": ("torch.distributed", "accelerate", "deepspeed", "ray"), "rollout": ("vllm",)}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted module name) for every import, `from a import b` giving both a and a.b, plus
    importlib.import_module("x") / __import__("x") calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def forbidden_imports(source: str, allowed: tuple[str, ...] = ()) -> list[str]:
    return [
        f"line {line}: {module}"
        for line, module in imported_modules(source)
        if any((module == banned or module.startswith(banned + ".")) and banned not in allowed for banned in FORBIDDEN)
    ]


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_pure_packages_exist():
    for package in PURE_PACKAGES:
        assert (PACKAGE / package / "__init__.py").is_file(), f"posttrain/{package}/ is gone; update PURE_PACKAGES"


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_distributed_machinery_or_vllm_only_in_its_layer(path):
    layer = path.relative_to(PACKAGE).parts[0]
    bad = forbidden_imports(path.read_text(encoding="utf-8"), ALLOWED_IN.get(layer, ()))
    assert not bad, (
        f"{path.relative_to(PACKAGE.parent)} imports {', '.join(bad)}; only posttrain/distributed/ may import "
        "torch.distributed, accelerate, deepspeed or ray, and only posttrain/rollout/ vllm (STYLE rule 5)"
    )


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "from torch import distributed",
        "from torch.distributed import all_reduce",
        "import accelerate",
        "from accelerate.utils import gather",
        "def f():\n    import deepspeed",
        "from vllm import LLM",
        "import importlib\nimportlib.import_module('vllm.sampling_params')",
        "__import__('accelerate')",
    ],
)
def test_checker_catches(source):
    assert forbidden_imports(source)


@pytest.mark.parametrize("source", ["import torch", "from torch import nn", "import accelerated_things", "import math"])
def test_checker_allows(source):
    assert not forbidden_imports(source)


def test_each_layer_may_import_only_its_own_machinery():
    distributed, rollout = ALLOWED_IN["distributed"], ALLOWED_IN["rollout"]
    assert not forbidden_imports("import deepspeed\nfrom accelerate import Accelerator", distributed)
    assert forbidden_imports("from vllm import LLM", distributed)
    assert not forbidden_imports("from vllm import LLM", rollout)
    assert forbidden_imports("import torch.distributed as dist", rollout)
