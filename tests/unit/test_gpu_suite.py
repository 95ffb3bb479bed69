"""bench/gpu_suite.py without running a row: the plan holds docs/performance.md's GPU rows and the plan rows inside the
time a lent GPU gives (each part one 10-minute command, 25 minutes in all), rows say why they cannot run, results of
separate parts merge into one file, and the markdown carries every row with its figures or its reason."""

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", BENCH / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_suite", module)
    spec.loader.exec_module(module)
    return module


GPU_ROWS = {"sft 0.5b bs8x1024", "sft 0.5b bs8x1024 gc", "dpo 0.5b bs8x1024", "grpo 0.5b bs32x128",
            "sft 1.5b bs8x2048 gc", "dpo 1.5b bs8x1024 gc"}


def _found(cuda=True, missing=None, core=()):
    return {"device": {"cuda": cuda, "name": "GPU" if cuda else "CPU", "bf16": True}, "missing": missing or {},
            "missing_core": list(core), "unmet": {}, "modules": {}}


def test_gpu_plan_holds_every_row_within_the_lent_time(tmp_path):
    suite = load_suite()
    rows = suite.plan_rows("gpu", tmp_path, "posttrain,trl")
    assert {r.name for r in rows if r.kind == "compare"} == GPU_ROWS
    assert {r.name for r in rows if r.kind == "plan"} == {f"plan {a} 0.5b {e}" for a in ("sft", "dpo", "grpo")
                                                          for e in ("ddp1", "zero2", "zero3")}
    per_part = {p: sum(r.budget_s for r in rows if p in r.parts) for p in (1, 2, 3)}
    assert all(seconds <= 540 for seconds in per_part.values()), per_part  # + preflight: one 10-minute command
    assert sum(per_part.values()) <= 25 * 60, per_part
    for row in rows:
        assert {"cuda", "bf16"} <= set(row.needs), row
        assert all(any(p in r.parts for p in row.parts) for r in rows if r.name in row.after), row  # model made first
    gc = next(r for r in rows if r.name == "sft 1.5b bs8x2048 gc").command
    assert gc[gc.index("--size") + 1] == "1.5b" and "--gc" in gc and gc[gc.index("--seq") + 1] == "2048"
    zero3 = next(r for r in rows if r.name == "plan dpo 0.5b zero3").command
    assert "recipes/accelerate/zero3.yaml" in zero3 and "train.mixed_precision=bf16" in zero3


def test_a_real_model_directory_is_trained_by_every_row_and_distils_too(tmp_path):
    suite = load_suite()
    rows = suite.plan_rows("gpu", tmp_path, "posttrain,trl", model_dir="/models/smollm2")
    compare = [r for r in rows if r.kind == "compare"]
    assert {r.command[r.command.index("--algo") + 1] for r in compare} == {"sft", "dpo", "grpo", "distill"}
    assert all(r.command[r.command.index("--model") + 1] == "/models/smollm2" for r in compare)
    assert all(r.command[r.command.index("--model") + 1] == "/models/smollm2" for r in rows if r.kind == "plan")
    assert len({r.name for r in rows}) == len(rows)


def test_tiny_rows_are_the_same_rows_without_a_gpu(tmp_path):
    suite = load_suite()
    gpu, tiny = suite.plan_rows("gpu", tmp_path, "posttrain"), suite.plan_rows("tiny", tmp_path, "posttrain")
    assert [r.name for r in tiny] == [r.name for r in gpu]
    assert all(set(r.needs) <= {"deepspeed"} for r in tiny)
    assert {r.command[r.command.index("--size") + 1] for r in tiny if "--size" in r.command} == {"tiny"}


def test_rows_say_why_they_cannot_run(tmp_path):
    suite = load_suite()
    rows = {r.name: r for r in suite.plan_rows("gpu", tmp_path, "posttrain,trl")}
    assert "needs a CUDA device" in suite.skip_reason(rows["sft 0.5b bs8x1024"], _found(cuda=False))
    no_deepspeed = _found(missing={"deepspeed": "ModuleNotFoundError: No module named 'deepspeed'"})
    assert "needs deepspeed: ModuleNotFoundError" in suite.skip_reason(rows["plan sft 0.5b zero2"], no_deepspeed)
    assert suite.skip_reason(rows["plan sft 0.5b ddp1"], no_deepspeed) is None
    assert suite.skip_reason(rows["dpo 0.5b bs8x1024"], _found(missing={"trl": "x"})) is None  # posttrain's side runs
    assert "datasets: No module" in suite.skip_reason(rows["prepare 0.5b"], _found(core=["datasets: No module"]))


def _info(device="H100"):
    return {"device": {"cuda": True, "name": device, "memory_gib": 79.1, "cuda_version": "13.0"},
            "versions": {"torch": "2.11.0", "trl": "1.16.0"}, "code": "0.1.0 abc", "commit": "abc",
            "date": "2026-11-24T10:00:00+00:00"}


def test_parts_merge_into_one_file_and_another_device_keeps_the_older(tmp_path):
    suite = load_suite()
    rows = suite.plan_rows("gpu", tmp_path / "work", "posttrain,trl")
    found, out = _found(), tmp_path / "out"
    figures = {"tools": {"posttrain": {"s/step": 0.4, "peak GB": 10.0, "start-up s": 30.0},
                         "trl": {"s/step": 0.5, "peak GB": 20.0, "start-up s": 20.0}}, "errors": {}}
    suite.write_results(out, "gpu", _info(), found, rows, {"sft 0.5b bs8x1024": {
        "status": "passed", "reason": None, "seconds": 61.0, "figures": figures}}, ["--part", "1"])
    suite.write_results(out, "gpu", {**_info(), "date": "2026-11-24T10:10:00+00:00"}, found, rows, {
        "plan sft 0.5b zero2": {"status": "failed", "reason": "over its 46 s budget: stopped", "seconds": 46.0}},
        ["--part", "2"])
    doc = json.loads((out / "results.json").read_text())
    by_name = {r["name"]: r for r in doc["rows"]}
    assert [r["name"] for r in doc["rows"]] == [r.name for r in rows]
    assert by_name["sft 0.5b bs8x1024"]["status"] == "passed" and by_name["plan sft 0.5b zero2"]["status"] == "failed"
    assert by_name["dpo 0.5b bs8x1024"]["status"] == "not run" and "part 1" in by_name["dpo 0.5b bs8x1024"]["reason"]
    assert len(doc["runs"]) == 2 and doc["environment"]["date"] == "2026-11-24T10:00:00+00:00"
    table = (out / "results.md").read_text()
    assert "| 1.25x | 0.50x | 1.50x | passed in 61 s |" in table  # speed 0.5/0.4, memory 10/20, start-up 30/20
    assert "failed in 46 s: over its 46 s budget: stopped" in table
    assert all(r.name in table for r in rows)

    suite.write_results(out, "gpu", _info("H200"), found, rows, {}, ["--part", "3"])
    assert json.loads((out / "results-2026-11-24T100000Z.json").read_text())["rows"] == doc["rows"]
    fresh = json.loads((out / "results.json").read_text())
    assert {r["status"] for r in fresh["rows"]} == {"not run"} and fresh["environment"]["device"]["name"] == "H200"


def test_every_plan_row_is_a_valid_recipe(tmp_path):
    """The plan rows' overrides pass the recipe checks at both sizes (a GRPO batch that is no multiple of
    algo.num_generations would fail at start, on the GPU)."""
    suite = load_suite()
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH / "plan_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for size in ("gpu", "tiny"):
        for row in (r for r in suite.plan_rows(size, tmp_path, "posttrain") if r.kind == "plan"):
            at = row.command.index("--algorithm") + 1
            overrides = tuple(arg for arg in row.command[at + 1:] if "=" in arg)
            recipe = bench.bench_recipe(row.command[at], "model", tmp_path / "d.jsonl", tmp_path / "o", 3, overrides)
            assert recipe.train.mixed_precision == "bf16", row
