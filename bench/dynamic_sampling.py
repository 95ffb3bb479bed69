"""DAPO dynamic sampling on the demo task: GRPO from the demo's SFT model with and without it, same seed, same steps.

    .venv/bin/python bench/dynamic_sampling.py --out runs/bench-dynamic --steps 40

Makes the demo's tiny model, data and SFT stage (posttrain/demo/arithmetic.py, FULL shape, --sft-steps of it), then
runs the demo's GRPO stage (128 completions a step: 16 prompts x 8, exact match) twice: plain, and with
algo.dynamic_sampling {metric: accuracy, max_batches: 4}. Writes curves.png (per step: the kept fraction of the drawn
groups; the reward over every drawn completion, which is the plain run's reward/mean; held-out accuracy) and one JSON
line of the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from posttrain.demo import FULL, online_overrides, stage
from posttrain.models.tiny import make_tiny_model
from posttrain.demo.tasks import write_example_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-dynamic")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=FULL.sft_steps)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out, size, seed = Path(args.out), FULL, args.seed
    tiny = make_tiny_model(out / "tiny", hidden_size=size.hidden_size, num_layers=size.num_layers, num_heads=4,
                           num_kv_heads=2, intermediate_size=4 * size.hidden_size, seed=seed)
    data = write_example_data(out / "data", n_train=size.n_train, n_eval=size.n_eval, max_operand=size.max_operand,
                              max_addend=size.max_addend, n_rl=size.n_rl, carry_slip=size.carry_slip, seed=seed)
    sft_final = out / "sft" / "final"
    if not (sft_final / "config.json").is_file():
        stage("sft", out, [
            f"model.name_or_path={tiny}", f"data.train={data['sft_train']}", "data.packing=true",
            "data.max_length=64", "train.per_device_train_batch_size=32", "train.learning_rate=3e-3",
            "train.lr_scheduler_type=cosine", "train.warmup_ratio=0.05", "train.weight_decay=0.01",
            f"train.max_steps={args.sft_steps}", "train.logging_steps=50", "train.report=false"], seed)
    figures = {}
    for name, extra in (("plain", []), ("dynamic", ["algo.dynamic_sampling.enabled=true",
                                                    "algo.dynamic_sampling.metric=accuracy",
                                                    "algo.dynamic_sampling.max_batches=4"])):
        started = time.perf_counter()
        run = stage("grpo", out / name, online_overrides(sft_final, data, args.steps) + [
            "algo.num_generations=8", "algo.beta=0.0", "train.logging_steps=1", "train.report=false", *extra], seed)
        rows = run.metrics
        train = [r for r in rows if "reward/mean" in r]
        evals = [r for r in rows if "eval/accuracy" in r]
        figures[name] = {"seconds": time.perf_counter() - started, "steps": [r["step"] for r in train],
                         "drawn_reward": [r.get("dynamic_sampling/drawn_reward_mean", r["reward/mean"]) for r in train],
                         "trained_reward": [r["reward/mean"] for r in train],
                         "zero_std": [r["frac_reward_zero_std"] for r in train],
                         "kept_fraction": [r.get("dynamic_sampling/kept_fraction", 1 - r["frac_reward_zero_std"])
                                           for r in train],
                         "eval_steps": [r["step"] for r in evals], "eval_accuracy": [r["eval/accuracy"] for r in evals]}
    plot(figures, out / "curves.png")
    print(json.dumps({k: {"seconds": round(v["seconds"]), "eval_accuracy": v["eval_accuracy"],
                          "mean_kept_fraction": sum(v["kept_fraction"]) / len(v["kept_fraction"]),
                          "mean_drawn_reward": sum(v["drawn_reward"]) / len(v["drawn_reward"])}
                      for k, v in figures.items()}))
    (out / "figures.json").write_text(json.dumps(figures))


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, f in figures.items():
        axes[0].plot(f["steps"], f["kept_fraction"], label=name)
        axes[1].plot(f["steps"], f["drawn_reward"], label=f"{name}: every drawn completion")
        if name == "dynamic":
            axes[1].plot(f["steps"], f["trained_reward"], "--", label="dynamic: the groups trained on")
        axes[2].plot(f["eval_steps"], f["eval_accuracy"], "o-", label=name)
    titles = ("groups whose accuracy varies (kept fraction)", "reward (exact match)", "held-out accuracy (greedy)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
