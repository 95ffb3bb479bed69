"""STYLE rule 5: the pure layers never import distributed machinery or vLLM.

Only posttrain/distributed/ may import torch.distributed, accelerate or deepspeed, and only posttrain/rollout/
may import vllm. This reads the source with ast (nothing is imported), so it also covers imports inside functions.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
PURE_PACKAGES = ("ops", "losses", "algorithms", "rewards", "config")
FORBIDDEN = ("torch.distributed", "accelerate", "deepspeed", "vllm")


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


def forbidden_imports(source: str) -> list[str]:
    return [
        f"line {line}: {module}"
        for line, module in imported_modules(source)
        if any(module == banned or module.startswith(banned + ".") for banned in FORBIDDEN)
    ]


def pure_source_files() -> list[Path]:
    return sorted(path for package in PURE_PACKAGES for path in (PACKAGE / package).rglob("*.py"))


def test_the_pure_packages_exist():
    for package in PURE_PACKAGES:
        assert (PACKAGE / package / "__init__.py").is_file(), f"posttrain/{package}/ is gone; update PURE_PACKAGES"


@pytest.mark.parametrize("path", pure_source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_pure_module_imports_no_distributed_or_vllm(path):
    bad = forbidden_imports(path.read_text(encoding="utf-8"))
    assert not bad, (
        f"{path.relative_to(PACKAGE.parent)} imports {', '.join(bad)}; only posttrain/distributed/ may import "
        "torch.distributed, accelerate or deepspeed, and only posttrain/rollout/ vllm (STYLE rule 5)"
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
