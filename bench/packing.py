"""Padded vs padding-free vs token-budget micro-batches on rows of mixed lengths (64 to 2,048 tokens): seconds per
step and peak memory for SFT, DPO and GRPO, posttrain's three ways beside TRL's padded and padding_free runs, side by
side, each run in a fresh process (clean peaks).

    .venv/bin/python bench/packing.py                      # SFT, DPO and GRPO, 4 steps each, a 256-wide 4-layer Llama
    .venv/bin/python bench/packing.py --algo dpo --steps 6 --batch 8 --tools posttrain

Modes (the same model, data, seed, global batch and learning rate; posttrain's update is the same in its three,
tests/integration/test_packing.py):
- padded: micro-batches of `--batch` pairs / `--batch` prompts x 4 generations / 4 x `--batch` SFT rows, padded to
  their longest row;
- packed: data.packing=true, the same micro-batches with their forwards on the real tokens only;
- budget: data.packing=true and train.max_tokens_per_microbatch (the longest unit the recipe allows), the rows
  regrouped into as few micro-batches within it as fit;
- TRL padded, and TRL padding_free where TRL 1.16 has it: SFTConfig(padding_free=True) flattens each batch into one
  row with position ids. DPOConfig has the field but DPOTrainer 1.16 turns it off ("temporarily unavailable after
  a refactor", falling back to padding) and GRPOConfig has none, so those cells say so instead of running.
Rows are short enough (at most ~0.42 x --max-length words, ~2.2 tokens each here) that neither tool truncates them,
which TRL's padding_free without packing requires (max_length=None).
TRL reads the rows in posttrain's seeded order (sequential sampling over the reordered dataset) and in float32
without autocast (TRL's configs default to bf16), so each step of every run sees the same rows and each run's
per-step losses and grad norms, printed beside its timings, agree with the others' (SFT and DPO; GRPO samples its
completions, so its losses differ between the tools).
s/step is the mean wall time of the steps after the first (posttrain: tokens of a step / the logged
tokens_per_second; TRL: between its step-end callbacks); peak memory is the process's peak RSS on a CPU (model,
optimiser, activations and the ~0.5 GB of interpreter and libraries), CUDA's peak on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "the model learns to add numbers and answer questions about short stories in plain words".split()
MODES = {"padded": [], "packed": ["data.packing=true"], "budget": ["data.packing=true"]}
TRL_MODES = ("TRL padded", "TRL padding_free")
TRL_PADDING_FREE = {"sft": None, "dpo": "off in TRL 1.16 (DPOTrainer falls back to padding)",
                    "grpo": "not in TRL 1.16 (GRPOConfig has no padding_free)"}
"""Why TRL's padding_free cell of an algorithm is not run (None: it is)."""


def length_reward(prompts, completions, **_):
    """GRPO's reward here: longer completions score higher (varies within a group even for a random model)."""
    return [len(c) / 40.0 for c in completions]


def lengths(rows: int, low: int, high: int, seed: int) -> list[int]:
    """Word counts spread log-uniformly between low and high (long-tailed, as reasoning traces are)."""
    rng = random.Random(seed)
    return [int(low * (high / low) ** rng.random()) for _ in range(rows)]


def text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def write_data(work: Path, rows: int, low: int, high: int) -> dict[str, Path]:
    rng = random.Random(0)
    files = {algo: work / f"{algo}.jsonl" for algo in ("sft", "dpo", "grpo")}
    with files["sft"].open("w") as f:
        for n in lengths(rows, low, high, seed=3):
            f.write(json.dumps({"prompt": text(8, rng), "completion": " " + text(n, rng)}) + "\n")
    with files["dpo"].open("w") as f:
        for n in lengths(rows, low, high, seed=1):
            f.write(json.dumps({"prompt": text(8, rng), "chosen": " " + text(n, rng),
                                "rejected": " " + text(max(1, int(n * rng.uniform(0.5, 1.0))), rng)}) + "\n")
    with files["grpo"].open("w") as f:
        for n in lengths(rows, low, high, seed=2):
            f.write(json.dumps({"prompt": text(n, rng), "answer": "4"}) + "\n")
    return files


def rows_per_step(a, algo: str) -> int:
    """Per-device rows of a step: SFT rows, DPO pairs, GRPO completions."""
    return a.batch if algo == "dpo" else a.batch * 4


def overrides(a, algo: str, mode: str, model: Path, data: Path, out: Path) -> list[str]:
    common = [f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}", f"train.max_steps={a.steps}",
              "train.logging_steps=1", "train.report=false", "train.tensorboard=false", "seed=3",
              "train.learning_rate=1e-4", "train.lr_scheduler_type=constant", "train.save_steps=0",
              "train.save_final_model=false", f"data.max_length={a.max_length}", "data.packing=false",
              f"train.per_device_train_batch_size={rows_per_step(a, algo)}", "train.gradient_accumulation_steps=1",
              *MODES[mode]]
    budget = a.max_length
    if algo == "dpo":
        common += ["algo.precompute_ref_logprobs=false"]  # the reference scores every step, as TRL's does
        budget = 2 * a.max_length
    elif algo == "grpo":
        common += ["algo.num_generations=4", f"generation.max_completion_length={a.completion}", "algo.beta=0.0",
                   f"data.max_prompt_length={a.max_length}", "rewards=[{name: 'bench.packing:length_reward'}]"]
        budget = a.max_length + a.completion
    return common + ([f"train.max_tokens_per_microbatch={budget}"] if mode == "budget" else [])


def run_posttrain(a, algo: str, mode: str, model: Path, data: Path, work: Path) -> dict:
    out = work / f"{algo}-{mode}"
    cmd = [sys.executable, "-m", "posttrain", algo, *overrides(a, algo, mode, model, data, out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{algo} {mode} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    tokens = [b["num_tokens"] - a_["num_tokens"] for a_, b in zip(rows, rows[1:])]
    seconds = [t / r["tokens_per_second"] for t, r in zip(tokens, rows[1:])]
    return {"s/step": sum(seconds) / max(1, len(seconds)), "peak MB": max(r["peak_memory_mb"] for r in rows),
            "losses": [r["loss"] for r in rows], "grad norms": [r["grad_norm"] for r in rows]}


def run_trl(a, algo: str, mode: str, model: Path, data: Path, work: Path) -> dict:
    """TRL in a fresh process (this file with --trl-child), the same model, data and numbers."""
    cmd = [sys.executable, __file__, "--trl-child", algo, mode, str(model), str(data), str(work / f"trl-{algo}"),
           "--steps", str(a.steps), "--batch", str(a.batch), "--max-length", str(a.max_length),
           "--completion", str(a.completion)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not result:
        raise SystemExit(f"TRL {algo} {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(result[0][len("RESULT "):])


def trl_child(a, algo: str, mode: str, model: str, data: str, out: str) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from posttrain.train.sources import SampleOrder

    torch.manual_seed(3)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    common = dict(output_dir=out, per_device_train_batch_size=rows_per_step(a, algo), max_steps=a.steps,
                  learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                  report_to="none", dataloader_num_workers=0, disable_tqdm=True, seed=3,
                  gradient_checkpointing=False,  # TRL 1.16's configs default to True; posttrain's to False
                  bf16=False,  # TRL 1.16's configs default to bf16 autocast; posttrain's to none (float32, as here)
                  use_cpu=not torch.cuda.is_available())
    dataset = load_dataset("json", data_files=data, split="train")
    # posttrain's seeded order (train.dataloader_seed = seed = 3), read in sequence: both tools see the same rows at
    # each step, so their per-step losses can be compared (TRL's own shuffle draws another order)
    order = SampleOrder(len(dataset), seed=3)
    dataset = dataset.select([order.index(i) for i in range(len(dataset))])
    common["train_sampling_strategy"] = "sequential"
    padding_free = mode == "TRL padding_free"
    if algo == "sft":
        from trl import SFTConfig, SFTTrainer

        # padding_free without packing leaves rows as they are and refuses a max_length: the rows here are shorter
        config = SFTConfig(max_length=None if padding_free else a.max_length, padding_free=padding_free, **common)
        trainer = SFTTrainer(model=policy, args=config, train_dataset=dataset, processing_class=tokenizer)
    elif algo == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=policy, args=DPOConfig(max_length=a.max_length, **common), train_dataset=dataset,
                             processing_class=tokenizer)
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(num_generations=4, max_completion_length=a.completion, beta=0.0, temperature=1.0,
                            shuffle_dataset=False, **common)
        trainer = GRPOTrainer(model=policy, args=config, train_dataset=dataset, processing_class=tokenizer,
                              reward_funcs=[length_reward])
    trainer.add_callback(StepEnds())
    trainer.train()
    gaps = [b - a_ for a_, b in zip(ends, ends[1:])]
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("RESULT " + json.dumps({"s/step": sum(gaps) / max(1, len(gaps)), "peak MB": peak / 2**20,
                                  "losses": losses,
                                  "grad norms": [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]}),
          flush=True)


def _env() -> dict:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def _cell(result) -> str:
    return result if isinstance(result, str) else f"{result['s/step']:.2f} s/step, {result['peak MB']:,.0f} MB"


def _losses(result: dict) -> str:
    """Per-step figures of a run, to compare the tools step by step (they see the same rows at each step)."""
    return "; ".join(f"{key} " + " ".join(f"{x:.4f}" for x in result[key]) for key in ("losses", "grad norms"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=["sft", "dpo", "grpo", "all"], default="all")
    p.add_argument("--tools", default="posttrain,trl", help="posttrain, trl or both (default)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="pairs (DPO), prompts (GRPO, x 4 generations) or x 4 SFT "
                   "rows per step")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--completion", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--trl-child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_child:
        return trl_child(a, *a.trl_child)
    from posttrain.models.tiny import make_tiny_model

    tools = a.tools.split(",")
    table: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", hidden_size=a.hidden, num_layers=a.layers, num_heads=8, num_kv_heads=4,
                                intermediate_size=a.hidden * 3, max_position_embeddings=a.max_length + a.completion)
        data = write_data(work, a.rows, 30, int(a.max_length * 0.42))  # ~65 to ~2,000 tokens: no row is cut
        print(f"model: hidden {a.hidden}, {a.layers} layers | rows of ~64-{a.max_length} tokens | {a.steps} steps")
        for algo in (["sft", "dpo", "grpo"] if a.algo == "all" else [a.algo]):
            row = table.setdefault(algo, {})
            for mode in MODES if "posttrain" in tools else ():
                row[mode] = run_posttrain(a, algo, mode, model, data[algo], work)
                print(f"{algo:5} {mode:17} {_cell(row[mode])}, {_losses(row[mode])}", flush=True)
            for mode in TRL_MODES if "trl" in tools else ():
                if mode == "TRL padding_free" and TRL_PADDING_FREE[algo]:
                    row[mode] = TRL_PADDING_FREE[algo]
                    continue
                row[mode] = run_trl(a, algo, mode, model, data[algo], work)
                print(f"{algo:5} {mode:17} {_cell(row[mode])}, {_losses(row[mode])}", flush=True)
    columns = [c for c in (*MODES, *TRL_MODES) if any(c in row for row in table.values())]
    print("\n| run | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for algo, row in table.items():
        print(f"| {algo}, {rows_per_step(a, algo)} {'pairs' if algo == 'dpo' else 'rows'}/step | "
              + " | ".join(_cell(row.get(c, "-")) for c in columns) + " |")


if __name__ == "__main__":
    main()
