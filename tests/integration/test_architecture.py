"""docs/architecture.md's count of one GRPO step through the files, measured: the posttrain files whose code runs
during the second step of a 3-step GRPO run on the tiny model (from the loop's second `step_batches` call to its
third; the first step also runs one-off set-up), every thread included. The doc gives the number and the list;
this test holds the doc to the code, so a change that spreads a step over more files is seen."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

from posttrain.demo.tasks import write_example_data
from tests.integration.helpers import run_cli, run_overrides
from tests.integration.test_grpo import HERE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "posttrain"


class FilesOfOneStep:
    """Records the posttrain files whose functions are called between two calls of the source's step_batches."""

    def __init__(self, record_call: int):
        self.calls = 0
        self.record_call = record_call
        self.files: set[str] = set()

    def profile(self, frame, event, arg):
        if event == "call" and self.calls == self.record_call:
            name = frame.f_code.co_filename
            if name.startswith(str(PACKAGE)):
                self.files.add(str(Path(name).relative_to(PACKAGE)))

    def wrap(self, step_batches):
        def counted(source, step):
            self.calls += 1
            return step_batches(source, step)
        return counted


def documented_files() -> tuple[int, set[str]]:
    """The count docs/architecture.md gives and the files it lists under it (indented lines ending in .py)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"Measured by tests/integration/test_architecture\.py: (\d+) files", text)
    assert found, "docs/architecture.md must say 'Measured by tests/integration/test_architecture.py: N files'"
    section = text[found.end():text.index("## One distillation step through the files")]
    return int(found.group(1)), set(re.findall(r"^    (\S+\.py)$", section, re.M))


def test_one_grpo_step_runs_in_the_files_the_architecture_doc_counts(tiny_model_dir, tmp_path, monkeypatch):
    from posttrain.online.rollout_source import RolloutSource

    data = write_example_data(tmp_path / "data", n_train=16, n_eval=2)
    seen = FilesOfOneStep(record_call=2)
    monkeypatch.setattr(RolloutSource, "step_batches", seen.wrap(RolloutSource.step_batches))
    sys.setprofile(seen.profile)
    threading.setprofile(seen.profile)
    try:
        code = run_cli("grpo", *run_overrides(tiny_model_dir, data["prompts_train"], tmp_path / "run",
                                              "train.max_steps=3", "train.per_device_train_batch_size=8",
                                              "generation.max_completion_length=8", "algo.num_generations=4",
                                              f"rewards=[{{name: '{HERE}:length_reward'}}]"))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert code == 0 and seen.calls == 3
    count, listed = documented_files()
    assert (len(seen.files), seen.files) == (count, listed), (
        f"one GRPO step now runs in {len(seen.files)} posttrain files, docs/architecture.md says {count}: update the "
        f"doc's count and list if the change is meant (new: {sorted(seen.files - listed)}, gone: "
        f"{sorted(listed - seen.files)})")
