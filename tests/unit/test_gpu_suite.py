"""bench/gpu_suite.py without running a row: the core rows come in the issue's order and fit 8 minutes with the
setup, rows for time left start only whole, rows say why they cannot run, the results file and its markdown carry
every row, and the first check names a missing piece within seconds (a real shell run, no GPU needed)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
CORE_ORDER = ["prepare 0.5b", "sft 0.5b bs8x1024", "dpo 0.5b bs8x1024", "grpo 0.5b bs32x128", "plan sft 0.5b bs8x1024"]


def load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", BENCH / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_suite", module)
    spec.loader.exec_module(module)
    return module


def _found(cuda=True, missing=None, core=()):
    return {"device": {"cuda": cuda, "name": "GPU" if cuda else "CPU", "bf16": True}, "missing": missing or {},
            "missing_core": list(core), "unmet": {}, "modules": {}}


def test_core_rows_come_in_order_and_fit_eight_minutes_with_the_setup(tmp_path):
    suite = load_suite()
    rows = suite.plan_rows("gpu", tmp_path, "posttrain,trl")
    core = [r for r in rows if r.core]
    assert [r.name for r in core] == CORE_ORDER and rows[:len(core)] == core  # the rows for time left come after
    total = suite.SETUP_S + sum(r.budget_s for r in core)
    assert total < 8 * 60 == suite.MINUTES * 60, total
    from posttrain.generation.serve import GRACE_SECONDS  # a row stopped at the deadline still ends in the call's 540 s

    assert suite.MINUTES * 60 + GRACE_SECONDS + 30 <= 540
    text = suite.plan_text(rows, {r.name for r in rows}, suite.MINUTES)
    assert f"{total:.0f} s  in all" in text and "480 s" in text
    assert all(f"{r.budget_s:.0f} s  {r.name}" in text for r in rows)
    assert text.index(CORE_ORDER[-1]) < text.index("only while time is left") < text.index("sft 1.5b bs8x2048 gc")

    extra = [r for r in rows if not r.core]
    assert [r.name for r in extra[:4]] == ["sft vision tiny-qwen2-vl 1 step", "prepare 1.5b", "sft 1.5b bs8x2048 gc",
                                           "dpo 1.5b bs8x1024 gc"]
    assert all("--gc" in r.command and r.command[r.command.index("--size") + 1] == "1.5b" for r in extra[2:4])
    # the vision row is the first the time left reaches: a core that ends 45 s inside its budgets runs it
    assert extra[0].command[:2] == ("python", "bench/vision_step.py") and extra[0].budget_s == 45
    for row in rows:
        assert {"cuda", "bf16"} <= set(row.needs), row
        assert all(rows.index(next(r for r in rows if r.name == n)) < rows.index(row) for n in row.after + row.reads)
    sft = next(r for r in rows if r.name == "sft 0.5b bs8x1024").command
    assert sft[sft.index("--bs") + 1] == "8" and sft[sft.index("--seq") + 1] == "1024" and "bf16" in sft
    plan = next(r for r in rows if r.name == "plan sft 0.5b bs8x1024")
    assert plan.reads == ("sft 0.5b bs8x1024",) and str(tmp_path / "0.5b" / "posttrain-sft") in plan.command


def test_a_real_model_directory_is_trained_by_every_row_and_distils_too(tmp_path):
    suite = load_suite()
    rows = suite.plan_rows("gpu", tmp_path, "posttrain,trl", model_dir="/models/smollm2")
    compare = [r for r in rows if r.kind == "compare"]
    assert {r.command[r.command.index("--algo") + 1] for r in compare} == {"sft", "dpo", "grpo", "distill"}
    assert all(r.command[r.command.index("--model") + 1] == "/models/smollm2" for r in compare)
    assert all(r.command[r.command.index("--model") + 1] == "/models/smollm2" for r in rows
               if r.kind == "prepare" or "--algorithm" in r.command)
    assert [r.name for r in rows if r.name.startswith("distill")] == ["distill 1.5b bs8x1024"]  # after the core
    assert len({r.name for r in rows}) == len(rows)


def test_tiny_rows_are_the_same_rows_without_a_gpu(tmp_path):
    suite = load_suite()
    gpu, tiny = suite.plan_rows("gpu", tmp_path, "posttrain"), suite.plan_rows("tiny", tmp_path, "posttrain")
    assert [r.name for r in tiny] == [r.name for r in gpu] and [r.core for r in tiny] == [r.core for r in gpu]
    assert all(set(r.needs) <= {"deepspeed"} for r in tiny)
    assert {r.command[r.command.index("--size") + 1] for r in tiny if "--size" in r.command} == {"tiny"}


def test_rows_say_why_they_do_not_start(tmp_path):
    suite = load_suite()
    rows = suite.plan_rows("gpu", tmp_path, "posttrain,trl")
    by = {r.name: r for r in rows}
    everything = {r.name for r in rows}

    def why(name, results=None, found=None, left=1000.0):
        row = by[name]
        return suite.why_not(row, rows, everything, results or {}, found or _found(), row.budget_s, left)

    assert "needs a CUDA device" in why("sft 0.5b bs8x1024", found=_found(cuda=False))
    no_deepspeed = _found(missing={"deepspeed": "ModuleNotFoundError: No module named 'deepspeed'"})
    assert "needs deepspeed: ModuleNotFoundError" in why("plan sft 0.5b zero2", found=no_deepspeed)
    assert why("plan dpo 0.5b ddp1", {"prepare 0.5b": {"status": "passed"}}, no_deepspeed) is None
    assert "datasets: No module" in why("prepare 0.5b", found=_found(core=["datasets: No module"]))
    assert "prepare 0.5b did not pass" in why("sft 0.5b bs8x1024", {"prepare 0.5b": {"status": "failed"}})
    made = {"prepare 0.5b": {"status": "passed"}}
    assert "sft 0.5b bs8x1024 did not run" in why("plan sft 0.5b bs8x1024", {**made, "sft 0.5b bs8x1024": {
        "status": "skipped"}})
    assert why("plan sft 0.5b bs8x1024", {**made, "sft 0.5b bs8x1024": {"status": "failed"}}) is None  # TRL failed
    # a core row starts with what is left (30 s at least); a row for time left only whole, a prepare row with its
    # first row's budget too
    assert why("grpo 0.5b bs32x128", made, left=31) is None
    assert "time is spent" in why("grpo 0.5b bs32x128", made, left=29)
    first = by["prepare 1.5b"].budget_s + by["sft 1.5b bs8x2048 gc"].budget_s
    assert f"needs {first:.0f} s" in why("prepare 1.5b", left=first - 1)
    assert why("prepare 1.5b", left=first) is None
    made_large = {"prepare 1.5b": {"status": "passed"}}
    budget = by["dpo 1.5b bs8x1024 gc"].budget_s
    assert why("dpo 1.5b bs8x1024 gc", made_large, left=budget - 1) and not why("dpo 1.5b bs8x1024 gc", made_large,
                                                                                 left=budget)


def _info():
    return {"device": {"cuda": True, "name": "H100", "memory_gib": 79.1, "cuda_version": "13.0"},
            "versions": {"torch": "2.11.0", "trl": "1.16.0"}, "code": "0.1.0 abc", "commit": "abc",
            "date": "2026-11-24T10:00:00+00:00"}


def test_results_carry_every_row_with_figures_or_a_reason(tmp_path):
    suite = load_suite()
    report = sys.modules["gpu_suite_report"]
    rows = suite.plan_rows("gpu", tmp_path / "work", "posttrain,trl")
    figures = {"tools": {"posttrain": {"s/step": 0.4, "peak GB": 10.0, "start-up s": 30.0},
                         "trl": {"s/step": 0.5, "peak GB": 20.0, "start-up s": 20.0}}, "errors": {}}
    plan = {"estimate": 3 * 2**30, "measured": 2 * 2**30, "error_percent": 50.0, "engine": "single", "device": "cuda"}
    results = {"prepare 0.5b": {"status": "passed", "seconds": 20.0},
               "sft 0.5b bs8x1024": {"status": "passed", "reason": None, "seconds": 61.0, "figures": figures},
               "dpo 0.5b bs8x1024": {"status": "running", "reason": "started with 110 s of budget"},
               "plan sft 0.5b bs8x1024": {"status": "passed", "seconds": 2.0, "figures": plan}}
    selected = {r.name for r in rows if r.core}
    doc = report.document("gpu", 8, _info(), _found(), rows, selected, results, ["--commit", "abc"])
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "row.log").write_text("a row's log")
    report.write_results(out, doc, out / "logs")
    by = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert list(by) == [r.name for r in rows]
    assert by["sft 0.5b bs8x1024"]["steps"] == "12 (3 left out)" and by["sft 0.5b bs8x1024"]["figures"] == figures
    assert by["grpo 0.5b bs32x128"]["status"] == "pending" and "stopped before" in by["grpo 0.5b bs32x128"]["reason"]
    assert by["prepare 1.5b"]["status"] == "not run"
    table = (out / "results.md").read_text()
    assert "| 12 (3 left out) |" in table and "| 1.25x | 0.50x | 1.50x | passed in 61 s |" in table
    assert "| single | cuda | 0.5b 8x1024 | 3072.0 MiB | 2048.0 MiB | +50.0% | passed in 2 s |" in table
    assert "running: started with 110 s" in table and all(r.name in table for r in rows)
    assert not list(out.glob("*.tmp")) and (out / "logs.tar.gz").stat().st_size > 0

    report.keep_earlier(out)  # a second run into the same folder keeps the first's files by their date
    assert json.loads((out / "results-2026-11-24T100000Z.json").read_text())["rows"] == doc["rows"]
    assert not (out / "results.json").exists()


def test_every_plan_row_is_a_valid_recipe(tmp_path):
    """The separate plan rows' overrides pass the recipe checks at both sizes (a GRPO batch that is no multiple of
    algo.num_generations would fail at start, on the GPU)."""
    suite = load_suite()
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH / "plan_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for size in ("gpu", "tiny"):
        for row in (r for r in suite.plan_rows(size, tmp_path, "posttrain") if "--algorithm" in r.command):
            at = row.command.index("--algorithm") + 1
            overrides = tuple(arg for arg in row.command[at + 1:] if "=" in arg)
            recipe = bench.bench_recipe(row.command[at], "model", tmp_path / "d.jsonl", tmp_path / "o", 3, overrides)
            assert recipe.train.mixed_precision == "bf16", row


def test_missing_pieces_are_those_neither_installed_nor_carried(tmp_path):
    load_suite()
    preflight = sys.modules["gpu_suite_preflight"]
    wanted = preflight.pins()
    assert ("trl", "1.16.0") in wanted and any(name == "deepspeed" for name, _ in wanted)
    absent = ("posttrain-absent-piece", "1.0")  # a distribution no machine has
    assert preflight.missing_pieces(tmp_path, [("packaging", "0"), absent]) == [
        f"posttrain-absent-piece==1.0: not installed, and no wheel for it in {tmp_path}/"]
    (tmp_path / "posttrain_absent_piece-1.0-py3-none-any.whl").write_bytes(b"")
    assert preflight.missing_pieces(tmp_path, [absent]) == []


def _run(command, **env):
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": "", **env})


def test_the_first_line_names_a_missing_piece_before_anything_runs(tmp_path):
    """bench/gpu_suite.sh under a Python without its site-packages (no torch, no trl: a bare image) stops within
    seconds naming torch and every carried piece, before installing or running anything."""
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    done = _run(["bash", "bench/gpu_suite.sh", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out")],
                PYTHON=str(bare))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "check: missing torch: ModuleNotFoundError" in done.stdout
    assert f"check: missing trl==1.16.0: not installed, and no wheel for it in {tmp_path / 'none'}/" in done.stdout
    assert "plan:" not in done.stdout and not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_first_line_refuses_a_machine_without_cuda(tmp_path):
    done = _run(["bash", "bench/gpu_suite.sh", "--out", str(tmp_path / "out")], PYTHON=sys.executable)
    assert done.returncode == 2 and "no CUDA device" in done.stdout and "the GPU rows need one" in done.stdout
    assert not (tmp_path / "out").exists()


def test_what_a_device_call_sends_is_held_under_its_limit(tmp_path):
    carried = tmp_path / "whl"
    carried.mkdir()
    (carried / "a.whl").write_bytes(b"\0" * 2 * 2**20)
    fits = _run(["bash", "scripts/carry_size.sh", str(carried)])
    assert fits.returncode == 0 and "MiB carried" in fits.stdout and "limit 64 MiB" in fits.stdout, fits.stderr
    sent = float(fits.stdout.split("carry_size.sh: ")[1].split(" MiB")[0])
    assert sent >= 2.0
    over = _run(["bash", "scripts/carry_size.sh", str(carried)], CARRY_LIMIT_MIB="1")
    assert over.returncode == 1 and "over the 1 MiB" in over.stderr


def test_the_plan_read_from_a_run_says_what_it_lacks(tmp_path):
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCH / "plan_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit, match="no metrics.jsonl row with peak_memory_mb"):
        bench.from_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "peak_memory_mb": 100.0}\n')
    with pytest.raises(SystemExit, match="logged no estimated_peak_memory_mb"):
        bench.from_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "peak_memory_mb": 100.0, "estimated_peak_memory_mb": 90.0}\n'
                                            '{"step": 2, "peak_memory_mb": 120.0, "estimated_peak_memory_mb": 90.0}\n')
    m = bench.from_run(tmp_path)
    assert (m["estimate"], m["measured"], m["steps"], m["engine"]) == (90 * 2**20, 120 * 2**20, 2, "single")
