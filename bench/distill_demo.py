"""Distil the demo's GRPO-trained model into a fresh, smaller student, against the same student trained by SFT alone
on the same rows, steps, batch and schedule; held-out exact match of each (and of the fresh student and the teacher).
Figures: docs/distill.md.

    posttrain demo --out runs/demo                                  # the teacher: runs/demo/grpo/final
    python bench/distill_demo.py --demo runs/demo --out runs/distill-demo

The rows are the demo's SFT demonstrations, the carry forgotten in half of those that carry. The student is fresh and
smaller (hidden 64, half the demo model's width; the demo's tokenizer). It first learns the task's format and most
sums by the demo's own SFT stage (`--warm-steps`, packed rows, as `posttrain demo` trains its model): learning to add
from scratch takes a 2-core CPU minutes of SFT steps, and a distillation step costs several (the teacher's forward),
so this shared start keeps the bench within ~15 minutes. From that student, three runs on the same rows with the
same steps, batch and schedule:
  sft        more SFT on the demonstrations (it imitates the forgotten carries too);
  kd         supervised KD (`algo.lmbda=0`): the teacher's next-token distributions on the same demonstrations;
  on-policy  GKD (`algo.lmbda`, default 0.5): that share of the steps on completions the student samples itself.
Held-out: the demo's 200 problems that no stage trained on, greedy exact match overall, on those that carry (where
the demonstrations slip) and on the rest. Writes <out>/results.json (after each run) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from posttrain.demo import held_out_accuracy, stage
from posttrain.models.tiny import make_tiny_model
from posttrain.demo.tasks import carries


def machine() -> dict:
    """What the seconds were measured on: CPU, cores, threads, and the 1-minute load average now."""
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.is_file() else []
    return {"platform": platform.platform(), "cpu": names[0] if names else platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_1min": round(os.getloadavg()[0], 2)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def split_by_carry(prompts: Path, out: Path) -> dict[str, Path]:
    """The held-out prompts in two files: problems whose ones digits carry (where the demonstrations slip) and the
    rest."""
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    parts: dict[str, list[str]] = {"carry": [], "no_carry": []}
    for row in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["prompt"][-1]["content"]).groups())
        parts["carry" if carries(a, b) else "no_carry"].append(json.dumps(row))
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in parts.items():
        (out / f"eval_{name}.jsonl").write_text("\n".join(lines) + "\n")
    return {name: out / f"eval_{name}.jsonl" for name in parts}


def accuracy(model_dir: Path, parts: dict[str, Path]) -> dict[str, float]:
    """Held-out exact match overall, on carrying problems and on the rest."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in parts.items()}
    out = {name: held_out_accuracy(model_dir, path) for name, path in parts.items()}
    out["all"] = sum(out[name] * sizes[name] for name in parts) / sum(sizes.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", required=True, help="a `posttrain demo` directory (grpo/final, data/)")
    parser.add_argument("--out", default="runs/distill-demo")
    parser.add_argument("--warm-steps", type=int, default=1600, help="the shared SFT start (the demo's SFT stage)")
    parser.add_argument("--steps", type=int, default=400, help="steps of each compared run")
    parser.add_argument("--batch", type=int, default=32, help="rows per step of each compared run")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="of each compared run (cosine)")
    parser.add_argument("--hidden-size", type=int, default=64, help="the student's (the demo's model has 128)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lmbda", type=float, default=0.5, help="the on-policy run's share of sampled steps")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    demo, out = Path(args.demo), Path(args.out)
    teacher, data = demo / "grpo" / "final", demo / "data"
    missing = [str(p) for p in (teacher / "config.json", data / "sft_train.jsonl", data / "prompts_eval.jsonl")
               if not p.is_file()]
    if missing:
        sys.exit(f"distill_demo: --demo {demo} lacks {', '.join(missing)}: run `posttrain demo --out {demo}` first")
    parts = split_by_carry(data / "prompts_eval.jsonl", out)
    results = {"teacher": str(teacher), **{k: v for k, v in vars(args).items() if k not in ("demo", "out")},
               "commit": commit(), "machine_at_start": machine(),
               "held_out": {name: len(path.read_text().splitlines()) for name, path in parts.items()}}
    results["teacher_accuracy"] = accuracy(teacher, parts)

    # the shared start: a fresh student, then the demo's SFT stage on it (packed rows, as posttrain demo trains)
    started = time.time()
    fresh = make_tiny_model(out / "student", hidden_size=args.hidden_size, num_layers=args.layers, num_heads=4,
                            num_kv_heads=2, intermediate_size=4 * args.hidden_size, seed=args.seed)
    warm = stage("sft", out / "warm", [
        f"model.name_or_path={fresh}", f"data.train={data / 'sft_train.jsonl'}", "data.packing=true",
        "data.max_length=64", "train.per_device_train_batch_size=32", "train.learning_rate=3e-3",
        "train.lr_scheduler_type=cosine", "train.warmup_ratio=0.05", "train.weight_decay=0.01",
        f"train.max_steps={args.warm_steps}", "train.logging_steps=100", "train.report=false"], args.seed)
    student = warm.final_dir
    results["warm_seconds"] = round(time.time() - started, 1)
    results["student_before_accuracy"] = accuracy(student, parts)
    results["runs"] = {}
    print(f"[distill-demo] the student after {args.warm_steps} SFT steps: held-out exact match "
          f"{results['student_before_accuracy']['all']:.1%} ({results['warm_seconds']:.0f} s)", flush=True)

    common = [f"model.name_or_path={student}", f"data.train={data / 'sft_train.jsonl'}", "data.max_length=64",
              "data.packing=false", f"train.per_device_train_batch_size={args.batch}",
              f"train.learning_rate={args.learning_rate}", "train.lr_scheduler_type=cosine", "train.warmup_ratio=0.05",
              "train.weight_decay=0.01", f"train.max_steps={args.steps}", "train.logging_steps=50",
              "train.report=false"]
    distill = [f"algo.teacher_model_name_or_path={teacher}", f"algo.beta={args.beta}",
               "generation.max_completion_length=6", "generation.temperature=1.0"]
    runs = (("sft", "sft", []), ("kd", "distill", distill + ["algo.lmbda=0"]),
            ("on-policy", "distill", distill + [f"algo.lmbda={args.lmbda}"]))
    for name, command, extra in runs:
        started = time.time()
        result = stage(command, out / name, common + extra, args.seed)
        seconds = time.time() - started
        logged = [r for r in result.metrics if "loss" in r]
        results["runs"][name] = {"command": command, "seconds": round(seconds, 1),
                                 "held_out_accuracy": accuracy(result.final_dir, parts),
                                 "final_loss": logged[-1]["loss"] if logged else None,
                                 "load_1min_after": round(os.getloadavg()[0], 2)}
        (out / "results.json").write_text(json.dumps(results, indent=2))  # what is done so far, if stopped
        print(f"[distill-demo] {name}: held-out exact match {results['runs'][name]['held_out_accuracy']['all']:.1%} "
              f"({seconds:.0f} s)", flush=True)
    results["machine_at_end"] = machine()
    (out / "results.json").write_text(json.dumps(results, indent=2))

    sizes = results["held_out"]
    print(f"\n[distill-demo] held-out exact match ({sizes['carry']} carrying + {sizes['no_carry']} other problems); "
          f"student hidden {args.hidden_size} x {args.layers} layers; each run {args.steps} steps x {args.batch} rows; "
          f"seed {args.seed}")
    print(f"  {'':<32} {'all':>7} {'carry':>7} {'other':>7} {'seconds':>8}")
    rows = [("student before (warm start)", results["student_before_accuracy"], results["warm_seconds"])]
    labels = {"sft": "SFT on the demonstrations", "kd": "distill, supervised KD",
              "on-policy": f"distill, on-policy (lmbda {args.lmbda:g})"}
    rows += [(labels[name], run["held_out_accuracy"], run["seconds"]) for name, run in results["runs"].items()]
    rows.append(("teacher (the demo's GRPO model)", results["teacher_accuracy"], None))
    for label, acc, seconds in rows:
        print(f"  {label:<32} {acc['all']:>7.1%} {acc['carry']:>7.1%} {acc['no_carry']:>7.1%} "
              f"{'' if seconds is None else f'{seconds:.0f}':>8}")
    print(f"  summary: {out / 'results.json'}")


if __name__ == "__main__":
    main()
