"""`posttrain demo`: the whole pipeline on a laptop CPU, no downloads.

    posttrain demo                 # about 2 minutes on 2 CPU cores
    posttrain demo --quick         # a smoke run in a couple of minutes

1. a tiny random Llama-style model + a tokenizer trained here (posttrain make-tiny-model);
2. a synthetic task with a checkable answer: addition of a one-digit number to a two-digit one, asked and answered in chat (posttrain/tasks.py);
3. SFT on it, then held-out exact-match accuracy;
4. DPO on preferences (the right sum preferred to a near miss), held-out preference accuracy before and after;
5. GRPO from the SFT model with the exact-match reward, held-out accuracy before and after.
Each stage is an ordinary posttrain run (config.yaml, metrics.jsonl, report.html) under the demo directory.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from posttrain.tasks import write_example_data


@dataclass(frozen=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    n_train: int
    n_eval: int
    max_addend: int
    sft_steps: int
    dpo_steps: int
    grpo_steps: int


# two-digit + one-digit addition: 1000 distinct problems, 200 held out; the step counts leave SFT short of perfect so
# that DPO and GRPO have something to add
FULL = DemoSize(hidden_size=128, num_layers=4, n_train=800, n_eval=200, max_addend=9, sft_steps=800, dpo_steps=100,
                grpo_steps=400)
QUICK = DemoSize(hidden_size=64, num_layers=2, n_train=400, n_eval=40, max_addend=9, sft_steps=20, dpo_steps=4,
                 grpo_steps=4)


def stage(command: str, out: Path, overrides: list[str]):
    """One ordinary posttrain run, in-process, with the demo's run directory."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.run import run

    common = [f"output_dir={out / command}", "train.overwrite_output_dir=true", "train.save_steps=0",
              "train.save_total_limit=1", "seed=0"]
    recipe = load_recipe(None, common + overrides, ALGORITHMS[command][0])
    return run(command, recipe)


def held_out_accuracy(model_dir: Path, prompts_file: Path) -> float:
    from posttrain.algorithms.grpo_eval import exact_match_accuracy
    from posttrain.config.schema import DataConfig, ModelConfig
    from posttrain.data import load_rows, tokenize_prompts
    from posttrain.models.load import load_causal_lm, load_tokenizer

    model_cfg = ModelConfig(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(model_cfg)
    examples, _ = tokenize_prompts(load_rows(str(prompts_file)), tokenizer, DataConfig(train=str(prompts_file)), "demo")
    return exact_match_accuracy(load_causal_lm(model_cfg), tokenizer, examples, max_new_tokens=8)


def preference_accuracy(model_dir: Path, pairs_file: Path) -> float:
    from posttrain.algorithms.dpo import preference_accuracy as accuracy

    return accuracy(str(model_dir), examples=str(pairs_file))


def run_demo(out_dir: str = "runs/demo", quick: bool = False) -> dict:
    from posttrain.models.tiny import make_tiny_model

    size = QUICK if quick else FULL
    out = Path(out_dir)
    started = time.time()
    tiny = make_tiny_model(out / "tiny", hidden_size=size.hidden_size, num_layers=size.num_layers, num_heads=4,
                           num_kv_heads=2, intermediate_size=4 * size.hidden_size, seed=0)
    data = write_example_data(out / "data", n_train=size.n_train, n_eval=size.n_eval, max_addend=size.max_addend)
    results: dict = {}

    print(f"\n[demo 1/3] SFT on {size.n_train} addition problems ({size.sft_steps} steps)", flush=True)
    sft = stage("sft", out, [
        f"model.name_or_path={tiny}", f"data.train={data['sft_train']}", f"data.eval={data['sft_eval']}",
        "data.packing=true", "data.max_length=64", "train.per_device_train_batch_size=32",
        "train.learning_rate=3e-3", "train.lr_scheduler_type=cosine", "train.warmup_ratio=0.05",
        "train.weight_decay=0.01", f"train.max_steps={size.sft_steps}", "train.logging_steps=10",
        f"train.eval_steps={max(1, size.sft_steps // 4)}",
    ])
    results["sft_accuracy"] = held_out_accuracy(sft.final_dir, data["prompts_eval"])
    print(f"[demo] SFT held-out exact-match accuracy: {results['sft_accuracy']:.1%}", flush=True)

    print(f"\n[demo 2/3] DPO: the right sum preferred to a near miss ({size.dpo_steps} steps)", flush=True)
    results["dpo_pref_accuracy_before"] = preference_accuracy(sft.final_dir, data["pref_eval"])
    dpo = stage("dpo", out, [
        f"model.name_or_path={sft.final_dir}", f"data.train={data['pref_train']}", f"data.eval={data['pref_eval']}",
        "data.max_length=64", "train.per_device_train_batch_size=16", "train.learning_rate=5e-5",
        "train.lr_scheduler_type=constant", f"train.max_steps={size.dpo_steps}", "train.logging_steps=5",
        f"train.eval_steps={max(1, size.dpo_steps // 2)}", "algo.beta=0.1",
    ])
    results["dpo_pref_accuracy_after"] = preference_accuracy(dpo.final_dir, data["pref_eval"])
    # DPO's own held-out metric: how often the implicit reward beta * log(pi / pi_ref) ranks the right sum first
    # (50% is chance: before training pi == pi_ref and every pair is a tie)
    results["dpo_implicit_reward_accuracy"] = [r for r in dpo.metrics if "eval/rewards/accuracies" in r][-1][
        "eval/rewards/accuracies"]
    results["dpo_accuracy"] = held_out_accuracy(dpo.final_dir, data["prompts_eval"])
    print(f"[demo] held-out preference accuracy: {results['dpo_pref_accuracy_before']:.1%} -> "
          f"{results['dpo_pref_accuracy_after']:.1%}; exact match after DPO {results['dpo_accuracy']:.1%}", flush=True)

    print(f"\n[demo 3/3] GRPO from the SFT model with the exact-match reward ({size.grpo_steps} steps)", flush=True)
    grpo = stage("grpo", out, [
        f"model.name_or_path={sft.final_dir}", f"data.train={data['prompts_train']}", f"data.eval={data['prompts_eval']}",
        "data.max_length=64", "data.max_prompt_length=48", "train.per_device_train_batch_size=64",
        "train.learning_rate=2e-4", "train.lr_scheduler_type=constant", f"train.max_steps={size.grpo_steps}",
        "train.logging_steps=5", f"train.eval_steps={max(1, size.grpo_steps // 3)}", "generation.max_completion_length=6",
        "generation.temperature=1.0", "algo.num_generations=8", "algo.beta=0.0",
        "rewards=[{name: exact_match}]",
    ])
    results["grpo_accuracy"] = held_out_accuracy(grpo.final_dir, data["prompts_eval"])
    results["minutes"] = (time.time() - started) / 60
    results["held_out_prompts"] = size.n_eval
    results["reports"] = {name: str(out / name / "report.html") for name in ("sft", "dpo", "grpo")}
    (out / "demo_results.json").write_text(json.dumps(results, indent=2))

    print("\n[demo] results on", size.n_eval, "held-out problems")
    print(f"  exact-match accuracy  after SFT {results['sft_accuracy']:.1%} | after DPO {results['dpo_accuracy']:.1%} "
          f"| after GRPO {results['grpo_accuracy']:.1%}")
    print(f"  preference accuracy   before DPO {results['dpo_pref_accuracy_before']:.1%} "
          f"| after DPO {results['dpo_pref_accuracy_after']:.1%} (log p(right) > log p(wrong) under the policy)")
    print(f"  DPO implicit-reward accuracy on held-out pairs: {results['dpo_implicit_reward_accuracy']:.1%} (chance 50%)")
    print(f"  {results['minutes']:.1f} minutes; reports: " + ", ".join(results["reports"].values()))
    print(f"  summary: {out / 'demo_results.json'}")
    return results
