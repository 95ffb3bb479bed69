"""`posttrain.rollout` is the old name of `posttrain.generation`, kept one release: the same module objects, one
FutureWarning."""

import importlib
import subprocess
import sys


def test_old_name_gives_the_same_modules_with_one_warning():
    code = ("import warnings; warnings.simplefilter('always');\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    import posttrain.rollout.server as old; from posttrain.rollout import make_engine\n"
            "import posttrain.generation.server as new; from posttrain.generation import engines\n"
            "assert old is new and make_engine is engines.make_engine\n"
            "print(sum('posttrain.generation' in str(w.message) for w in caught))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"


def test_new_name_imports_without_the_old():
    assert importlib.import_module("posttrain.generation").make_engine is not None
