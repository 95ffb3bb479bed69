"""Python imports this at start-up in every process whose PYTHONPATH holds tests/distributed/hooks/site (launch.py
puts it there when a test asks for hooks). It loads the hooks named in POSTTRAIN_TEST_HOOKS into the training
workers (they have a RANK), never into the launchers (torchrun, accelerate launch). Product code knows nothing of
this. The folder holds nothing else, so no hook module can shadow a standard-library name."""

import importlib
import os

if os.environ.get("POSTTRAIN_TEST_HOOKS") and "RANK" in os.environ:
    for _name in os.environ["POSTTRAIN_TEST_HOOKS"].split(","):
        importlib.import_module(f"tests.distributed.hooks.{_name}")
