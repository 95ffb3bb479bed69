"""`bench/compare_trl.py --startup`: a user's cold start of each tool's own command line, one SFT step each.

    .venv/bin/python bench/compare_trl.py --startup --repeats 3 [--posttrain-path OTHER_CHECKOUT]
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def startup_side_by_side(a) -> None:
    """A user's cold start, command line to command line: `posttrain sft --config recipes/sft.yaml` against `trl sft`
    with the same model, data file (the shipped conversational SFT rows), batch and max_length, one optimiser step,
    nothing saved. Each a fresh process, in alternating order, `--repeats` times; prints wall and CPU seconds from
    launch to exit (the median), so neither tool's figure depends on which ran on a quieter moment."""
    import statistics

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from posttrain.models.tiny import make_tiny_model

        model = make_tiny_model(work / "tiny")
        (work / "sft").mkdir()
        shutil.copy(root / "examples" / "data" / "sft_train.jsonl", work / "sft" / "train.jsonl")
        common = [f"model.name_or_path={model}", f"data.train={work / 'sft' / 'train.jsonl'}", "data.eval=null",
                  "train.max_steps=1", "train.save_final_model=false", "train.report=false",
                  "train.tensorboard=false", "train.save_steps=0", "train.overwrite_output_dir=true"]
        commands = {"posttrain": ([sys.executable, "-m", "posttrain", "sft", "--config",
                                   str(root / "recipes" / "sft.yaml"), f"output_dir={work / 'pt'}", *common], root)}
        if a.posttrain_path:
            commands["posttrain (other)"] = (commands["posttrain"][0][:-len(common) - 1]
                                             + [f"output_dir={work / 'pt2'}", *common], Path(a.posttrain_path))
        trl = shutil.which("trl", path=str(Path(sys.executable).parent))
        if trl:
            commands["trl"] = ([trl, "sft", "--model_name_or_path", str(model), "--dataset_name", str(work / "sft"),
                                "--output_dir", str(work / "trl"), "--max_steps", "1", "--per_device_train_batch_size",
                                "16", "--max_length", "128", "--save_strategy", "no", "--report_to", "none",
                                "--use_cpu", "--learning_rate", "1e-3"], root)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for r in range(a.repeats):
            for name in list(commands) if r % 2 == 0 else list(commands)[::-1]:
                argv, path = commands[name]
                env = {**os.environ, "PYTHONPATH": str(path), "HF_HUB_OFFLINE": "1"}
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.perf_counter()
                done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - started
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                if done.returncode:
                    sys.exit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
                times[name].append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    print(f"\ncold start, one SFT step on the tiny model (median of {a.repeats}; wall depends on the machine's load, "
          f"CPU seconds less so; load average now {os.getloadavg()[0]:.1f})")
    print("| command | wall s | CPU s |\n|---|---|---|")
    for name, runs in times.items():
        print(f"| {name} | {statistics.median(w for w, _ in runs):.1f} | {statistics.median(c for _, c in runs):.1f} |")
