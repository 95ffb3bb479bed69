"""Distil the demo's GRPO-trained model into a fresh, smaller student, against the same student trained by SFT alone
on the same rows, steps and batch; held-out exact match of both (and of the teacher). Figures: docs/distill.md.

    posttrain demo --out runs/demo                                  # the teacher: runs/demo/grpo/final
    python bench/distill_demo.py --demo runs/demo --out runs/distill-demo --steps 600

The rows are the demo's SFT demonstrations (the carry forgotten in half of those that carry). SFT imitates them; the
distilled student matches the teacher's distributions on them (`--lmbda` of the steps on its own samples instead).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from posttrain.demo import held_out_accuracy, stage
from posttrain.models.tiny import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", required=True, help="a `posttrain demo` directory (grpo/final, data/)")
    parser.add_argument("--out", default="runs/distill-demo")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--hidden-size", type=int, default=64, help="the student's (the demo's model has 128)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lmbda", type=float, default=0.5)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    demo, out = Path(args.demo), Path(args.out)
    teacher, data = demo / "grpo" / "final", demo / "data"
    student = make_tiny_model(out / "student", hidden_size=args.hidden_size, num_layers=args.layers, num_heads=4,
                              num_kv_heads=2, intermediate_size=4 * args.hidden_size, seed=args.seed)
    common = [f"model.name_or_path={student}", f"data.train={data / 'sft_train.jsonl'}", "data.max_length=64",
              "train.per_device_train_batch_size=32", "train.learning_rate=3e-3", "train.lr_scheduler_type=cosine",
              "train.warmup_ratio=0.05", "train.weight_decay=0.01", f"train.max_steps={args.steps}",
              "train.logging_steps=10", "train.report=false"]
    distill = [f"algo.teacher_model_name_or_path={teacher}", f"algo.lmbda={args.lmbda}", f"algo.beta={args.beta}",
               "generation.max_completion_length=6", "generation.temperature=1.0"]
    results = {"teacher": str(teacher), "steps": args.steps, "lmbda": args.lmbda, "beta": args.beta,
               "student_hidden_size": args.hidden_size, "student_layers": args.layers}
    for command, extra in (("sft", []), ("distill", distill)):
        started = time.time()
        result = stage(command, out, common + extra, args.seed)
        results[f"{command}_minutes"] = (time.time() - started) / 60
        results[f"{command}_accuracy"] = held_out_accuracy(result.final_dir, data / "prompts_eval.jsonl")
        print(f"[distill-demo] {command}: held-out exact match {results[f'{command}_accuracy']:.1%} "
              f"({results[f'{command}_minutes']:.1f} min)", flush=True)
    results["teacher_accuracy"] = held_out_accuracy(teacher, data / "prompts_eval.jsonl")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
