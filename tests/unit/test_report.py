"""report.html from synthetic run directories (no model): the headline first, each algorithm's key curves first,
smoothing, constant metrics as values, sampled completions, and several runs overlaid on one page."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.cli import run_command
from posttrain.report.write import (Figure, chart_series, constant_keys, headline_figures, load_run, load_runs,
                                    plan_charts, render, write_report)
from posttrain.report.charts import smooth, smoothing_weight


def write_run(path, rows, facts=None, config=None, samples=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if facts is not None:
        (path / "summary.json").write_text(json.dumps(facts))
    import yaml

    (path / "config.yaml").write_text(yaml.safe_dump(config or {"model": {"name_or_path": "tiny/"},
                                                             "data": {"train": "data/sft.jsonl"}}))
    if samples is not None:
        (path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


def sft_rows(lr_schedule=lambda step: 1e-4, steps=12):
    rows = [{"step": 0, "eval/loss": 3.0}]
    for step in range(1, steps + 1):
        rows.append({"step": step, "loss": 3.0 - 0.1 * step, "learning_rate": lr_schedule(step),
                     "tokens_per_second": 1000.0 + step, "peak_memory_mb": 500.0 + step,
                     "estimated_peak_memory_mb": 480.0, "time/update/policy": 0.1, "grad_norm": 1.0 / step})
        if step % 6 == 0:
            rows.append({"step": step, "eval/loss": 3.0 - 0.12 * step})
    return rows


GRPO_KEYS = {"loss", "reward/mean", "kl", "entropy", "clip_fraction", "completion_length/mean", "grad_norm",
             "eval/reward", "eval/accuracy", "eval/completion_length", "tokens_per_second", "peak_memory_mb",
             "time/generate", "learning_rate"}


def test_smoothing_is_tensorboards_debiased_moving_average():
    # by hand, w = 0.5: s1 = 0.5*1 / (1 - 0.5) = 1; s2 = 0.25 / 0.75 = 1/3; s3 = 0.125 / 0.875 = 1/7
    assert smooth([1.0, 0.0, 0.0], 0.5) == pytest.approx([1.0, 1 / 3, 1 / 7])
    assert smooth([3.0, 1.0], 0.0) == [3.0, 1.0]
    assert smooth([2.0] * 50, 0.9) == pytest.approx([2.0] * 50)  # debiased: a constant stays itself from the start
    assert smoothing_weight(9) == 0.0 and smoothing_weight(20) == pytest.approx(0.5) and smoothing_weight(10**4) == 0.9


def test_key_curves_come_first_per_algorithm_with_eval_beside_train():
    grpo, throughput, rest = plan_charts(["grpo"], GRPO_KEYS, constants=set())
    assert [c.title for c in grpo] == ["reward", "held-out accuracy", "KL to the reference", "entropy",
                                       "clip fraction", "loss", "completion length"]
    assert grpo[0].keys == ("reward/mean", "eval/reward")
    assert grpo[-1].keys == ("completion_length/mean", "eval/completion_length")
    assert [c.title for c in throughput] == ["tokens per second", "peak memory (MB)", "seconds per step, by phase"]
    assert {k for c in rest for k in c.keys} == {"grad_norm", "learning_rate"}

    # train.eval_pass_k: pass@k of each k beside the greedy accuracy, on one chart after the reward
    sampled, _, _ = plan_charts(["grpo"], GRPO_KEYS | {"eval/pass_at_1", "eval/pass_at_4", "eval/pass_at_16"}, set())
    assert sampled[1].title == "held-out accuracy (greedy) and pass@k (sampled)"
    assert sampled[1].keys == ("eval/accuracy", "eval/pass_at_1", "eval/pass_at_4", "eval/pass_at_16")
    assert [c.title for c in sampled[2:]] == [c.title for c in grpo[2:]]

    dpo_keys = {"loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "nll_loss",
                "eval/rewards/accuracies", "eval/nll_loss"}
    dpo, _, rest = plan_charts(["dpo"], dpo_keys, constants=set())
    assert [c.title for c in dpo] == ["loss", "reward accuracy", "reward margin", "implicit rewards"]
    assert dpo[1].keys == ("rewards/accuracies", "eval/rewards/accuracies")
    assert [c.keys for c in rest] == [("nll_loss", "eval/nll_loss")]  # the rest keep their eval beside them too

    sft, _, _ = plan_charts(["sft"], {"loss", "eval/loss", "mean_token_logprob"}, constants=set())
    assert [c.keys for c in sft] == [("loss", "eval/loss"), ("mean_token_logprob",)]


def test_constant_metrics_are_values_not_charts(tmp_path):
    run = load_run(write_run(tmp_path / "sft", sft_rows()))
    constants = constant_keys([run])
    assert constants == {"learning_rate", "estimated_peak_memory_mb", "time/update/policy"}
    key, throughput, rest = plan_charts(["sft"], run.keys(), constants)
    charted = {k for c in key + throughput + rest for k in c.keys}
    assert "learning_rate" not in charted and "time/update/policy" not in charted
    # the estimate stays beside the measured peak (a dashed level there), and is in the values table
    assert ("peak_memory_mb", "estimated_peak_memory_mb") in [c.keys for c in throughput]
    page = render([run])
    table = page[page.index("Logged once or constant"):]
    assert re.search(r"<th>learning_rate</th><td class='num'>0.0001 <span class='note'>\(all 12 logs\)", table)
    assert "<th>estimated_peak_memory_mb</th>" in table
    # on a CPU the measured peak is the process's resident memory: the allocator estimate is not set beside it
    _, on_cpu, _ = plan_charts(["sft"], run.keys(), constants, on_cpu=True)
    memory = next(c for c in on_cpu if "peak_memory_mb" in c.keys)
    assert memory.keys == ("peak_memory_mb",) and "resident" in memory.title
    (run.path / "summary.json").write_text('{"command": "sft", "device": "cpu"}')
    page = render([load_run(run.path)])
    assert "peak resident memory of the process" in page and "<th>estimated_peak_memory_mb</th>" in page
    # a schedule that moves is a curve again
    moving = load_run(write_run(tmp_path / "linear", sft_rows(lambda step: 1e-4 * (1 - step / 20))))
    assert "learning_rate" not in constant_keys([moving])


def test_the_headline_comes_first_with_what_how_long_and_eval_figures(tmp_path):
    facts = {"command": "sft", "parameters": "0.46M (0.46M trainable)", "steps": 12, "global_batch": 8,
             "world_size": 1, "engine": "single", "device": "cpu", "minutes": 1.5}
    path = write_run(tmp_path / "sft-run", sft_rows(), facts=facts)
    page = write_report(path).read_text()
    assert page.index("<h1>posttrain sft · sft-run</h1>") < page.index("<h2>Curves</h2>")
    headline = page[: page.index("<h2>Curves</h2>")]
    for fact in ("<b>tiny/</b> on data/sft.jsonl", "12 steps", "1.5 min", "0.46M (0.46M trainable) parameters",
                 "global batch 8", "1 process (single, cpu)"):
        assert fact in headline, fact
    run = load_run(path)
    figures = {f.key: f for f in headline_figures(run, plan_charts(["sft"], run.keys(), set())[0])}
    assert list(figures) == ["loss", "eval/loss"]
    assert figures["loss"].last == (12, pytest.approx(1.8))  # 3.0 - 0.1 * 12
    assert figures["eval/loss"].detail() == "step 12 · from 3 at step 0 · best 1.56 at step 12"
    assert Figure("eval/reward", (0, 0.0), (20, 0.0), (0, 0.0)).detail() == "step 20 · unchanged since step 0"
    assert "<div class='v'>1.8</div>" in headline and "<div class='v'>1.56</div>" in headline
    # every held-out metric at the starting model (step 0), the end and its best
    assert ("<tr><th>eval/loss</th><td class='num'>3 (step 0)</td><td class='num'>1.56 (step 12)</td>"
            "<td class='num'>1.56 (step 12)</td></tr>") in headline
    assert "<img" in page and "src='data:image/png;base64," in page and "curves.png" not in page  # self-contained
    assert page.index("Logged once or constant") < page.index("All other metrics")  # grad_norm: collapsed below


def test_a_run_without_summary_json_is_still_drawn_and_its_algorithm_inferred(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s, "reward/mean": 0.1 * s, "kl": 0.01 * s} for s in range(1, 6)]
    run = load_run(write_run(tmp_path / "old", rows))
    assert run.command == "grpo" and run.facts == {}
    assert "<h1>posttrain grpo · old</h1>" in render([run])


def test_samples_table_shows_a_few_steps_with_the_best_and_worst_completions(tmp_path):
    samples = [{"step": step, "prompt": [{"role": "user", "content": f"What is {p} + 1?"}],
                "completion": f"<answer step={step} prompt={p} k={k}>", "reward": float(k) if p else 1.0,
                "rewards": {"exact": k},
                "advantage": k - 3.5, "truncated": k == 7}
               for step in (2, 4, 6, 8, 10, 12) for p in range(3) for k in range(8)]
    rows = [{"step": s, "loss": 1.0, "reward/mean": 0.5 + s} for s in range(1, 13)]
    page = render([load_run(write_run(tmp_path / "grpo", rows, facts={"command": "grpo"}, samples=samples))])
    table = page[page.index("<h2>Sampled completions</h2>"):]
    table = table[: table.index("</table>")]
    shown_steps = re.findall(r"<td rowspan='\d+'><b>(\d+)</b>", table)
    assert shown_steps == ["2", "6", "8", "12"]  # four steps: the first, the last and evenly between
    # prompt 0's completions all scored the same: the prompts whose rewards differ come first
    assert "What is 1 + 1?" in table and "What is 2 + 1?" in table and "What is 0 + 1?" not in table
    assert "&lt;answer step=12 prompt=1 k=7&gt;" in table and "&lt;answer step=12 prompt=1 k=0&gt;" in table
    assert "<answer" not in table  # completions are escaped, never markup
    assert table.count("<tr>") == 1 + 4 * 2 * 4  # header + steps x prompts x (best, worst and two between)
    assert "cut at max length" in table


def test_two_runs_overlay_on_one_comparison_page(tmp_path, capsys):
    config = {"model": {"name_or_path": "tiny/"}, "data": {"train": "d.jsonl"}, "train": {"learning_rate": 1e-4}}
    a = write_run(tmp_path / "a" / "sft", sft_rows(), facts={"command": "sft"}, config=config)
    config_b = {**config, "train": {"learning_rate": 3e-4}}
    b = write_run(tmp_path / "b" / "sft", sft_rows(lambda s: 3e-4, steps=10), facts={"command": "sft"},
                  config=config_b)
    out = tmp_path / "compare.html"
    assert run_command(["report", str(a), str(b), "--out", str(out)]) == 0
    assert f"report: {out}" in capsys.readouterr().out
    page = out.read_text()
    assert "<h1>posttrain · 2 runs compared</h1>" in page
    assert "<b>a/sft</b>" in page and "<b>b/sft</b>" in page  # same folder name: told apart by the parent
    differs = page[page.index("What differs between the recipes"):]
    assert "<th>train.learning_rate</th><td>0.0001</td><td>0.0003</td>" in differs
    runs = load_runs([a, b])
    loss_chart = plan_charts(["sft", "sft"], runs[0].keys() | runs[1].keys(), constant_keys(runs))[0][0]
    lines = chart_series(loss_chart, runs)
    assert [(s.label, s.eval) for s in lines] == [("a/sft · loss", False), ("a/sft · eval/loss", True),
                                                  ("b/sft · loss", False), ("b/sft · eval/loss", True)]
    assert lines[0].color == lines[1].color != lines[2].color  # a colour per run
    assert len(lines[2].steps) == 10


def test_report_of_a_folder_that_is_no_run_is_exit_2(tmp_path, capsys):
    assert run_command(["report", str(tmp_path)]) == 2
    assert "is not a run directory (no metrics.jsonl there)" in capsys.readouterr().err


def test_sampled_prompts_show_their_images_as_thumbnails(tmp_path):
    """samples.jsonl's `images` (data.images.image_names): each shown prompt's images as inline thumbnails, one
    group per question and image (the same question about two images is two prompts); a missing file is named."""
    import base64
    import io

    from PIL import Image

    Image.new("RGB", (200, 100), (200, 30, 30)).save(tmp_path / "wide.png")
    (tmp_path / "grpo").mkdir()
    Image.new("RGB", (20, 20), (0, 0, 200)).save(tmp_path / "grpo" / "small.png")
    question = [{"role": "user", "content": "What colour?"}]
    samples = [{"step": 1, "prompt": question, "images": images, "completion": f"c{k}", "reward": float(k),
                "advantage": 0.0} for images in ([str(tmp_path / "wide.png")], ["small.png", "gone.png"])
               for k in range(2)]
    page = render([load_run(write_run(tmp_path / "grpo", [{"step": 1, "loss": 1.0}], facts={"command": "grpo"},
                                      samples=samples))])
    table = page[page.index("<h2>Sampled completions</h2>"):]
    thumbs = re.findall(r"<img class='thumb' alt='([^']*)' title='[^']*' src='data:image/png;base64,([^']+)'>", table)
    assert [name for name, _ in thumbs] == [str(tmp_path / "wide.png"), "small.png"]  # relative: from the run dir
    sizes = [Image.open(io.BytesIO(base64.b64decode(png))).size for _, png in thumbs]
    assert sizes == [(96, 48), (20, 20)]  # the longer side at most 96 pixels, never enlarged
    assert "image gone.png: FileNotFoundError" in table
