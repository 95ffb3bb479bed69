"""The tool-use demo: does a model that calls a calculator learn more than the same pipeline without one?

    python -m posttrain.demo.tools --out runs/agents-demo          # ~20 minutes on 2 CPU cores (docs/agents.md)

Task: two-digit x two-digit multiplication, operands 32-99 so that every product has four digits. A tiny model
does not learn to multiply in minutes; with the calculator it only has to copy: the operands into the call and the
tool's result into its answer, each at a fixed place (the fixed widths keep the copies at fixed offsets, which a
tiny model learns far sooner than copying numbers of varying length). The tool is called in a compact form,
`calc 57 * 83`, read by a custom parser (agent.tool_parser).
Two pipelines, same tiny random model, same problems, same demonstrator who slips on 30% of the problems:
- tools: SFT on scripted traces (question -> `calc a * b` -> the tool's result -> the answer); a slip
  copies the second operand's last digit wrong into the call, and the trace carries the wrong result through. Then
  GRPO with the tool live (recipes/grpo_tools.yaml's settings): agent.tools, exact match on the last turn.
- plain: SFT on direct answers (a slip gives the same wrong product), then GRPO with exact match and no tool.
Held-out exact match is each GRPO run's eval/accuracy: greedy, whole trajectories for the tool pipeline; step 0 is
the SFT model, the last eval the GRPO model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import time
from pathlib import Path

from posttrain.demo.tasks import write_jsonl

LOW, HIGH = 32, 99  # 32 * 32 = 1024: every product has four digits
SYSTEM = "Tools: calculator"
# The tiny model's ChatML with a one-line tools turn: the full JSON schema is ~350 tokens of the tiny tokenizer,
# longer than everything else in a trace together.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(', ')) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """Evaluate one arithmetic operation on two integers.

    Args:
        expression: Two integers and an operator, e.g. "123 + 456".
    """
    match = _EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"cannot evaluate {expression!r}; write two integers and one of + - *")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def parse_call(text: str) -> list[dict]:
    """The demo's compact tool-call format, read by a custom agent.tool_parser: `calc 57 * 83` calls the
    calculator (the Hermes JSON form costs ~70 tokens of the tiny tokenizer, `calc ...` ~10)."""
    if not text.startswith("calc "):
        return []
    return [{"name": "calculator", "arguments": {"expression": text[len("calc "):]}}]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def problems(seed: int) -> list[tuple[int, int]]:
    """Every (a, b) with LOW <= a, b <= HIGH, in a seeded order (the splits take disjoint runs of it)."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs


def slipped(b: int, rng: random.Random) -> int:
    """b with its last digit changed: a copying slip (still two digits)."""
    return b - b % 10 + (b % 10 + rng.randint(1, 9)) % 10


def traces(pairs, slip: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(tool-using SFT rows, direct-answer SFT rows) from one demonstrator: a slip uses a wrong second operand."""
    rng = random.Random(seed)
    tool_rows, plain_rows = [], []
    for a, b in pairs:
        shown_b = slipped(b, rng) if rng.random() < slip else b
        tool_rows.append({"messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question(a, b)},
            {"role": "assistant", "content": f"calc {a} * {shown_b}"},
            {"role": "tool", "content": str(a * shown_b)}, {"role": "assistant", "content": str(a * shown_b)}]})
        plain_rows.append({"prompt": [{"role": "user", "content": question(a, b)}],
                           "completion": [{"role": "assistant", "content": str(a * shown_b)}]})
    return tool_rows, plain_rows


def prompts(pairs) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a * b)} for a, b in pairs]


def run_demo(out_dir: str, sft_steps: int, grpo_steps: int, seed: int = 0, slip: float = 0.3,
             pipelines: tuple[str, ...] = ("plain", "tools")) -> dict:
    from posttrain.demo.arithmetic import stage
    from posttrain.models.tiny import make_tiny_model

    out = Path(out_dir)
    started = time.time()
    tiny = make_tiny_model(out / "tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                           intermediate_size=512, seed=seed)
    pairs = problems(seed)  # 4,624 problems: 100 held out, 1,000 GRPO prompts, 3,000 SFT traces, all disjoint
    held_out, rl_problems, sft_problems = pairs[:100], pairs[100:1100], pairs[1100:4100]
    tool_rows, plain_rows = traces(sft_problems, slip, seed)
    data = out / "data"
    files = {"sft_tools": write_jsonl(tool_rows, data / "sft_tools.jsonl"),
             "sft_plain": write_jsonl(plain_rows, data / "sft_plain.jsonl"),
             "rl": write_jsonl(prompts(rl_problems), data / "prompts_train.jsonl"),
             "eval": write_jsonl(prompts(held_out), data / "prompts_eval.jsonl")}
    (out / "tools.jinja").write_text(TEMPLATE)
    results: dict = {"task": f"a * b, {LOW} <= a, b <= {HIGH}", "sft_steps": sft_steps, "grpo_steps": grpo_steps,
                     "held_out": len(held_out), "slip": slip, "seed": seed,
                     "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads "
                                f"{os.environ.get('OMP_NUM_THREADS', 'default')}"}
    for name in pipelines:
        began = time.time()
        sft = stage("sft", out / name, [
            f"model.name_or_path={tiny}", f"data.train={files['sft_' + name]}", "data.packing=true",
            "data.max_length=128", "train.per_device_train_batch_size=16", "train.learning_rate=3e-3",
            "train.lr_scheduler_type=cosine", "train.warmup_ratio=0.05", "train.weight_decay=0.01",
            f"train.max_steps={sft_steps}", "train.logging_steps=20"], seed)
        sft_seconds = time.time() - began
        overrides = [f"model.name_or_path={sft.final_dir}", f"data.train={files['rl']}", f"data.eval={files['eval']}",
                     "data.max_length=64", "train.per_device_train_batch_size=32", "train.learning_rate=1e-4",
                     "train.lr_scheduler_type=constant", f"train.max_steps={grpo_steps}", "train.logging_steps=5",
                     f"train.eval_steps={grpo_steps}", "generation.temperature=1.0", "algo.num_generations=8",
                     "rewards=[{name: exact_match}]"]
        if name == "tools":
            overrides += [f"model.chat_template={out / 'tools.jinja'}", "generation.max_completion_length=48",
                          "agent.tools=[posttrain.demo.tools:calculator]",
                          "agent.tool_parser=posttrain.demo.tools:parse_call",
                          "agent.max_turns=2"]
        else:
            overrides += ["generation.max_completion_length=8"]
        grpo = stage("grpo", out / name, overrides, seed)
        evals = [r for r in grpo.metrics if "eval/accuracy" in r]
        rewards = [r["reward/mean"] for r in grpo.metrics if "reward/mean" in r]
        results[name] = {"sft_accuracy": evals[0]["eval/accuracy"], "grpo_accuracy": evals[-1]["eval/accuracy"],
                         "sft_final_loss": [r["loss"] for r in sft.metrics if "loss" in r][-1],
                         "grpo_reward_first": rewards[0], "grpo_reward_last": rewards[-1],
                         "sft_seconds": round(sft_seconds), "grpo_seconds": round(time.time() - began - sft_seconds)}
        if name == "tools":
            steps = [r for r in grpo.metrics if "tools/calls" in r]
            results[name].update({"tool_calls_per_step": steps[-1]["tools/calls"],
                                  "tool_errors_last_step": steps[-1]["tools/errors"],
                                  "turns_mean_last_step": steps[-1]["turns/mean"]})
        print(f"[demo_tools] {name}: held-out exact match after SFT {results[name]['sft_accuracy']:.1%}, after GRPO "
              f"{results[name]['grpo_accuracy']:.1%}", flush=True)
    results["minutes"] = (time.time() - started) / 60
    (out / f"results-{'-'.join(pipelines)}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/agents-demo")
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--pipelines", default="plain,tools", help="plain, tools or both (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run_demo(args.out, args.sft_steps, args.grpo_steps, args.seed, pipelines=tuple(args.pipelines.split(",")))


if __name__ == "__main__":
    main()
