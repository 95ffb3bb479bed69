"""The import rules of docs/architecture.md, read from the source with ast (nothing is imported, so imports inside
functions count too):

- STYLE rule 5: only posttrain/distributed/ and posttrain/launch/ import distributed machinery (torch.distributed,
  accelerate, deepspeed, ray), only posttrain/generation/ imports vLLM;
- the layers: a module imports only from its own layer or the ones below (LAYERS, top first), and no two posttrain
  modules import each other, directly or round a loop.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
PURE_PACKAGES = ("ops", "losses", "algorithms", "rewards", "config")
FORBIDDEN = ("torch.distributed", "accelerate", "deepspeed", "ray", "vllm")
MACHINERY = ("torch.distributed", "accelerate", "deepspeed", "ray")
ALLOWED_IN = {"distributed": MACHINERY, "launch": MACHINERY, "generation": ("vllm",)}
LAYERS = [
    ("cli", "__main__", "console", "demo"),                         # the command line, and the demos it runs
    ("launch",),                                                    # what starts processes: Ray, serve children, doctor
    ("run", "roles", "rundir", "plan", "report"),                   # composition of one run, and what it writes
    ("online",),                                                    # sampling, scoring, the online batch, evaluation
    ("train",),                                                     # the loop every algorithm shares, offline sources
    ("algorithms", "agents"),                                       # prepare + loss plug-ins; multi-turn rollouts
    ("generation", "rollout", "rewards", "models", "data"),         # engines (rollout: its old name), rewards, models, data
    ("distributed",),                                               # what runs inside a training process
    ("ops", "losses", "config", "batch", "errors", "rundir.files", "usercode", "__init__"),   # pure
]
LAYER_OF = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}


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
        f"{path.relative_to(PACKAGE.parent)} imports {', '.join(bad)}; only posttrain/distributed/ and launch/ may "
        "import torch.distributed, accelerate, deepspeed or ray, and only posttrain/generation/ vllm (STYLE rule 5)"
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def posttrain_imports() -> dict[str, set[str]]:
    """posttrain module -> the posttrain modules it imports (`from a import b` counts as a and a.b when that is a
    module). A package's __init__ only gathers its modules' names, so its own imports are not followed (as
    ../shared/tools/import_facts.py counts them)."""
    modules = {module_name(p): p for p in source_files()}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        if path.name == "__init__.py":
            edges[name] = found
            continue
        for _, imported in imported_modules(path.read_text(encoding="utf-8")):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported.startswith("posttrain") and imported != name and imported != "posttrain":
                found.add(imported)
        edges[name] = found
    return edges


def layer(module: str) -> int:
    """The layer of a module: its longest dotted prefix below posttrain named in LAYERS (`rundir.files` before
    `rundir`), so a package may keep one pure module beside the ones that compose a run."""
    parts = module.split(".")[1:] or ["__init__"]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYER_OF:
            return LAYER_OF[".".join(parts[:end])]
    raise AssertionError(f"{module}: add posttrain/{parts[0]} to a layer of LAYERS (and to docs/architecture.md)")


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{a} -> {b}" for a, imported in posttrain_imports().items() for b in imported if layer(b) > layer(a)]
    assert not upward, f"imports up the layers of docs/architecture.md: {upward}"


def test_no_import_cycles():
    edges = posttrain_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles among posttrain's modules: {cycles}"


def test_the_checks_see_a_violation():
    assert layer("posttrain.algorithms.grpo") < layer("posttrain.train.loop")  # so algorithms -> train is caught
    assert layer("posttrain.distributed.backend") < layer("posttrain.launch.ray_roles")
    assert "posttrain.run" in posttrain_imports()["posttrain.launch.ray_launcher"]


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
    distributed, rollout = ALLOWED_IN["distributed"], ALLOWED_IN["generation"]
    assert not forbidden_imports("import ray", ALLOWED_IN["launch"])
    assert not forbidden_imports("import deepspeed\nfrom accelerate import Accelerator", distributed)
    assert forbidden_imports("from vllm import LLM", distributed)
    assert not forbidden_imports("from vllm import LLM", rollout)
    assert forbidden_imports("import torch.distributed as dist", rollout)


def folder(module: str) -> str:
    """The folder (top-level package or loose module) below posttrain a module lives in."""
    return module.split(".")[1] if "." in module else "__init__"


def test_no_folder_imports_a_folder_that_imports_it_back():
    """Layers allow two folders of one layer to import each other; this forbids it, function-local imports included,
    so each folder can be read (and moved) knowing which folders it leans on."""
    edges: dict[str, set[str]] = {}
    for module, imported in posttrain_imports().items():
        edges.setdefault(folder(module), set()).update(folder(b) for b in imported if folder(b) != folder(module))
    loops = sorted(f"{a} <-> {b}" for a, targets in edges.items() for b in targets if a < b and a in edges.get(b, ()))
    assert not loops, f"folders importing each other: {loops}"


def test_every_posttrain_import_names_something_that_exists():
    """Function-local imports run only on their path (the demo's, a rare error's): after a module moves, one still
    naming the old place would fail there, late. Each `from posttrain.x import y` in the package must resolve now."""
    import importlib

    missing = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("posttrain")):
                continue
            if node.module.startswith("posttrain.rollout"):  # the old name's alias warns on import (tested apart)
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, f"imports of names that do not exist: {missing}"
