"""Fixtures of the distributed tests: task data, the one-process reference runs, and the 2-process run of each
engine, launched once per session and read by several tests (equivalence, sharding, export, resume)."""

from __future__ import annotations

import pytest

from tests.distributed.launch import ENGINES, Result, launch
from tests.distributed.recipes import TWO_PROCESS_SPLIT, sft_overrides
from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import ONE_PROCESS_SPLITS, final_weights, metrics, run_cli, step_losses


@pytest.fixture(scope="session")
def task_data(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("dist-data"), n_train=64, n_eval=16)


class OneProcessRuns(dict):
    """{split: (per-step losses, final weights)}; `.metrics[split]`: the run's logged rows (grad norms included)."""

    metrics: dict[str, list[dict]]


@pytest.fixture(scope="session")
def one_process(tiny_model_dir, task_data, tmp_path_factory):
    """OneProcessRuns for 1 process x micro-batch 4 and 1 process x 1 x accumulation 4."""
    root = tmp_path_factory.mktemp("one-process")
    out = OneProcessRuns()
    out.metrics = {}
    for name, extra in ONE_PROCESS_SPLITS.items():
        assert run_cli("sft", *sft_overrides(tiny_model_dir, task_data, root / name, *extra)) == 0
        out[name] = (step_losses(root / name), final_weights(root / name))
        out.metrics[name] = metrics(root / name)
    return out


@pytest.fixture(scope="session")
def two_process_run(tiny_model_dir, task_data, tmp_path_factory):
    """engine -> the 2 processes x micro-batch 1 x accumulation 2 run under it (launched on first use)."""
    root = tmp_path_factory.mktemp("two-process")
    runs: dict[str, Result] = {}

    def get(engine: str) -> Result:
        if engine not in runs:
            overrides = sft_overrides(tiny_model_dir, task_data, root / engine, *TWO_PROCESS_SPLIT)
            runs[engine] = launch(2, "sft", overrides, hooks=["engine_facts"], **ENGINES[engine])
        return runs[engine]

    return get
