"""The old name of `posttrain.generation`, kept for one release so that imports written against it still work.

`import posttrain.rollout.server` and `from posttrain.rollout import make_engine` give the very module objects of
`posttrain.generation` (one module, not a copy: its state and classes are shared), with one FutureWarning.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from posttrain.generation import *  # noqa: F401,F403  (the package's public names, as before)
from posttrain.generation import __all__  # noqa: F401

OLD, NEW = "posttrain.rollout", "posttrain.generation"

warnings.warn(f"{OLD} is now {NEW}; the old name will be removed in the next release", FutureWarning, stacklevel=2)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `posttrain.rollout.X` with the already-importable `posttrain.generation.X`."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith(OLD + ".") else None

    def create_module(self, spec):
        return importlib.import_module(NEW + spec.name[len(OLD):])

    def exec_module(self, module):
        """The module ran when `posttrain.generation` imported it; nothing runs twice."""


sys.meta_path.insert(0, _Alias())
