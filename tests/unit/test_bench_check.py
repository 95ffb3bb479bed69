"""bench/bench_check.py and bench/trl_shapes.py without running a benchmark: a ratio more than 10% worse than its
baseline fails and one within it or better passes; the checked-in baselines carry what they must (the command that
bench-check reruns, commit, machine and load, the checked ratios); the trained-token counter counts only forwards
that autograd records; the realistic shapes are sized in the model's own tokens."""

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name):
    sys.path.insert(0, str(BENCH))  # bench_check and compare_trl import their neighbours by name
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def baseline(**ratios):
    return {"ratios to TRL": {"trained forward tokens": 0.3, "peak memory": 0.5, "CPU time": 1.0, **ratios},
            "checked": ["trained forward tokens", "peak memory", "CPU time"], "tolerance": 0.10}


def test_a_ratio_more_than_ten_percent_worse_fails():
    worse = load("bench_check").worse
    assert worse(baseline(), baseline()) == []
    assert worse(baseline(), baseline(**{"CPU time": 1.09, "peak memory": 0.3})) == []  # within 10%, and better
    off = worse(baseline(), baseline(**{"CPU time": 1.11}))
    assert len(off) == 1 and off[0].startswith("CPU time: 1.110 against 1.000")
    assert len(worse(baseline(), baseline(**{"trained forward tokens": 0.34, "peak memory": 0.56}))) == 2


@pytest.mark.parametrize("name", ["grpo", "dpo", "agents"])
def test_checked_in_baselines_hold_their_command_and_figures(name):
    check = load("bench_check")
    recorded = json.loads((BENCH / "baselines" / f"{name}.json").read_text())
    assert recorded["command"].split(" --tools ")[0] == "python bench/compare_trl.py " + " ".join(check.RUNS[name])
    assert recorded["checked"] == list(check.CHECKED) and recorded["tolerance"] == check.TOLERANCE
    assert recorded["commit"] and recorded["machine"]["cores"] and len(recorded["machine"]["load average at start"]) == 3
    for tool in ("posttrain", "posttrain-plain", "trl"):
        assert recorded["tools"][tool]["CPU s/step"] > 0 and recorded["tools"][tool]["peak GB"] > 0
    ours, theirs = recorded["tools"]["posttrain"], recorded["tools"]["trl"]
    for ratio, key in check.CHECKED.items():
        assert recorded["ratios to TRL"][ratio] == pytest.approx(ours[key] / theirs[key])
    # every row's prompt is computed once per group (a pair) where TRL computes it per row
    assert ours["trained forward tokens/step"] < recorded["tools"]["posttrain-plain"]["trained forward tokens/step"]


def test_trained_tokens_counts_forwards_autograd_records():
    shapes = load("trl_shapes")
    embedding = torch.nn.Embedding(10, 4)
    with shapes.TrainedTokens() as trained:
        embedding(torch.zeros(3, 5, dtype=torch.long))
        with torch.no_grad():
            embedding(torch.zeros(7, 5, dtype=torch.long))  # generation, reference and old-policy scores
    assert trained.count == 15
    assert torch.nn.Embedding.forward is trained._original  # the patch is undone


def test_realistic_rows_are_sized_in_the_models_tokens(tiny_model_dir):
    """The tiny model's tokenizer splits the bench's words into several tokens each: the rows still come out at the
    shape's token counts (DPO: prompt 4/7 of a row of 0.9 x 512 tokens; agents: at least one tool's schema)."""
    shapes = load("trl_shapes")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    words = "one two three cat dog tree house road river sky sun moon red blue green".split()
    say = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    pair = shapes.realistic_rows("dpo", tokenizer, say, SimpleNamespace(seq=512))[0]
    assert count(pair["prompt"]) == pytest.approx(512 * 0.9 * 4 / 7, rel=0.15)
    assert count(pair["chosen"]) == pytest.approx(512 * 0.9 * 3 / 7, rel=0.15)
    row = shapes.realistic_rows("agents", tokenizer, say, SimpleNamespace(prompt=512))[0]
    assert '"name": "get_weather"' in row["prompt"][0]["content"]
    grpo = shapes.realistic_rows("grpo", tokenizer, say, SimpleNamespace(prompt=384))[0]
    prompt = sum(count(m["content"]) for m in grpo["prompt"])
    assert prompt == pytest.approx(384, rel=0.15)
