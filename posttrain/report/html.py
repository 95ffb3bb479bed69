"""The report's markup: the page shell with its inline CSS, and the sections that are tables rather than charts
(headline, constant metrics, sampled completions, config differences, run facts). report/write.py assembles them.
"""

from __future__ import annotations

import html
import json

from posttrain.rundir.metrics import finite
from posttrain.report.charts import COLORS
from posttrain.report.files import GENERATOR
from posttrain.report.trackers import flatten

CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: #1f2937;
       margin: 0; background: #f8fafc; }
main { max-width: 1480px; margin: 0 auto; padding: 20px 28px 48px; }
h1 { font-size: 22px; margin: 4px 0 2px; }
h2 { font-size: 16px; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 1px solid #e2e8f0; }
.what { color: #475569; margin: 2px 0 14px; } .tiles { display: flex; flex-wrap: wrap; gap: 10px; }
.tile { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 8px 14px; min-width: 150px; }
.tile .k { color: #64748b; font-size: 12px; } .tile .v { font-size: 22px; font-weight: 600; }
.tile .d { color: #64748b; font-size: 11px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 10px; }
figure { margin: 0; background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 4px; }
figure img { width: 100%; height: auto; display: block; }
table { border-collapse: collapse; background: #fff; font-size: 13px; }
th, td { border: 1px solid #e2e8f0; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f1f5f9; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; max-height: 9em; overflow: auto; font-size: 12px; }
details { margin: 18px 0; } summary { cursor: pointer; font-weight: 600; font-size: 15px; }
.chip { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.note { color: #64748b; font-size: 12px; }
table.samples { width: 100%; } table.samples pre { min-width: 16em; }
img.thumb { max-width: 96px; max-height: 96px; margin: 4px 4px 0 0; border: 1px solid #e2e8f0;
            image-rendering: pixelated; }
.good { color: #15803d; } .bad { color: #b91c1c; }
"""
PAGE = ("<!doctype html><html><head><meta charset='utf-8'>" + GENERATOR
        + "<meta name='viewport' content='width=device-width'>"
        "<title>{title}</title><style>{css}</style></head><body><main>{body}</main></body></html>")
SAMPLE_STEPS = 4  # steps of samples.jsonl shown: the first, the last and evenly between
SAMPLE_GROUPS = 2  # prompts shown per step
SAMPLE_COMPLETIONS = 4  # completions shown per prompt: the best, the worst and between, by reward
THUMBNAIL = 96  # pixels, the longer side of a sampled prompt's image in the report


def page(title: str, body: str) -> str:
    return PAGE.format(title=html.escape(title), css=CSS, body=body)


def fmt(key: str, value: float) -> str:
    """A metric's value for people: accuracies as percentages, large numbers with separators."""
    if "accura" in key and 0 <= value <= 1:
        return f"{value:.1%}"
    return f"{value:,.0f}" if abs(value) >= 10000 else f"{value:.4g}"


def esc(value) -> str:
    return html.escape(str(value))


def tile(figure) -> str:
    return (f"<div class='tile'><div class='k'>{esc(figure.key)}</div>"
            f"<div class='v'>{esc(fmt(figure.key, figure.last[1]))}</div>"
            f"<div class='d'>{esc(figure.detail())}</div></div>")


def headline_single(title: str, description: str, figures, evals) -> str:
    """The title, what was trained on what for how long, the headline figures, and every held-out metric."""
    tiles = "".join(tile(f) for f in figures)

    def at(key, point) -> str:
        return f"{esc(fmt(key, point[1]))} (step {point[0]})" if point else "-"

    rows = "".join(f"<tr><th>{esc(f.key)}</th><td class='num'>{at(f.key, f.first)}</td><td class='num'>"
                   f"{at(f.key, f.last)}</td><td class='num'>{at(f.key, f.best)}</td></tr>" for f in evals)
    table = (f"<h2>Held-out evaluation</h2><table><tr><th>metric</th><th>first</th><th>last</th><th>best</th></tr>"
             f"{rows}</table>") if evals else ""
    return (f"<header><h1>{esc(title)}</h1><p class='what'>{description}</p><div class='tiles'>{tiles}</div>"
            f"{table}</header>")


def headline_table(runs, title: str, descriptions: list[str], figures_per_run: list[list]) -> str:
    """One row per run: its colour on the charts, what it trained, and its headline figures side by side."""
    keys = list(dict.fromkeys(f.key for figures in figures_per_run for f in figures))
    head = "<tr><th>run</th><th>what</th>" + "".join(f"<th>{esc(k)}</th>" for k in keys) + "</tr>"
    rows = []
    for r, (run, description, figures) in enumerate(zip(runs, descriptions, figures_per_run)):
        by_key = {f.key: f for f in figures}
        cells = "".join(f"<td class='num'>{esc(fmt(k, by_key[k].last[1]))}<div class='note'>"
                        f"{esc(by_key[k].detail())}</div></td>" if k in by_key else "<td></td>" for k in keys)
        chip = f"<span class='chip' style='background:{COLORS[r % len(COLORS)]}'></span>"
        rows.append(f"<tr><td>{chip}<b>{esc(run.name)}</b><div class='note'>{esc(run.command)} · {esc(run.path)}"
                    f"</div></td><td>{description}</td>{cells}</tr>")
    return f"<header><h1>{esc(title)}</h1><table>{head}{''.join(rows)}</table></header>"


def constants_table(runs, keys: list[str]) -> str:
    """Metrics logged once or never moving (a constant learning rate, the planner's memory estimate), as values."""
    if not keys:
        return ""

    def cell(run, key) -> str:
        steps, values = run.points(key)
        if not values:
            return "<td></td>"
        note = f"step {steps[0]}" if len(values) == 1 else f"all {len(values)} logs"
        return f"<td class='num'>{values[0]:.6g} <span class='note'>({note})</span></td>"

    head = "<tr><th>metric</th>" + "".join(f"<th>{esc(r.name)}</th>" for r in runs) + "</tr>" if len(runs) > 1 else ""
    rows = "".join(f"<tr><th>{esc(k)}</th>{''.join(cell(r, k) for r in runs)}</tr>" for k in keys)
    return f"<h2>Logged once or constant</h2><table>{head}{rows}</table>"


def prompt_text(prompt) -> str:
    """A sample's prompt as text: a chat's last user message, or the prompt string."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1])
    return str(prompt)


def spread(items: list, count: int) -> list:
    """count items spread over a list: the first, the last, and evenly between (all of them when fewer)."""
    return items if len(items) <= count else [items[i] for i in sorted({round(j * (len(items) - 1) / (count - 1))
                                                                        for j in range(count)})]


def samples_section(run) -> str:
    """Sampled completions with their rewards at a few steps (GRPO / PPO write samples.jsonl at each logging step):
    per step a few prompts (those whose rewards differ first), and per prompt its best, worst and middle
    completions by reward."""
    if not run.samples:
        return ""
    functions = list(dict.fromkeys(k for s in run.samples for k in _rewards(s)))
    per_function = functions if len(functions) > 1 else []
    head = ("<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th>"
            + "".join(f"<th>{esc(f)}</th>" for f in per_function) + "<th>advantage</th></tr>")
    steps = sorted({s.get("step", 0) for s in run.samples})
    rows = []
    for step in spread(steps, SAMPLE_STEPS):
        groups: dict[tuple[str, str], list] = {}  # one prompt: its text and its images (one question, many images)
        for sample in (s for s in run.samples if s.get("step", 0) == step):
            key = (prompt_text(sample.get("prompt", "")), json.dumps(sample.get("images"), default=str))
            groups.setdefault(key, []).append(sample)
        # the prompts whose completions disagree first: where the step had something to learn from
        disagreeing = sorted(groups.items(), key=lambda item: -len({_reward(s) for s in item[1]}))
        shown = [(prompt, spread(sorted(group, key=_reward, reverse=True), SAMPLE_COMPLETIONS))
                 for prompt, group in disagreeing[:SAMPLE_GROUPS]]
        step_rows = sum(len(group) for _, group in shown)
        for g, (prompt, group) in enumerate(shown):
            for i, sample in enumerate(group):
                cells = [f"<td rowspan='{step_rows}'><b>{esc(step)}</b></td>" if g == 0 and i == 0 else "",
                         f"<td rowspan='{len(group)}'><pre>{esc(prompt[0])}</pre>{thumbnails(sample, run.path)}</td>"
                         if i == 0 else "",
                         f"<td><pre>{esc(completion_text(sample))}</pre>"
                         + ("<span class='note'>cut at max length</span>" if sample.get("truncated") else "") + "</td>",
                         _number_cell(sample.get("reward"), reward=True)]
                cells += [_number_cell(_rewards(sample).get(f)) for f in per_function]
                cells.append(_number_cell(sample.get("advantage")))
                rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f"<h2>Sampled completions</h2><p class='note'>samples.jsonl holds {len(run.samples)} completions from "
            f"{len(steps)} logging steps; shown: steps {', '.join(map(str, spread(steps, SAMPLE_STEPS)))}, "
            f"{SAMPLE_GROUPS} prompts each (those whose rewards differ first), each prompt's best, worst and middle "
            "completions by reward</p>"
            f"<table class='samples'>{head}{''.join(rows)}</table>")


def thumbnails(sample, run_dir) -> str:
    """The sample's images (samples.jsonl's `images`: paths, relative ones from the run directory) as small inline
    PNGs; one that is missing or does not decode is named instead (the file may have been edited or moved)."""
    names = sample.get("images")
    if not isinstance(names, list):
        return ""
    return "".join(_thumbnail(str(name), run_dir) for name in names)


def _thumbnail(name: str, run_dir) -> str:
    import base64
    import io
    from pathlib import Path

    from PIL import Image

    path = Path(run_dir) / Path(name).expanduser()  # an absolute name stays itself
    try:
        with Image.open(path) as image:
            image.thumbnail((THUMBNAIL, THUMBNAIL))
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, format="PNG")
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # PIL's UnidentifiedImageError is an OSError
        return f"<div class='note'>image {esc(name)}: {esc(type(e).__name__)}</div>"
    png = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"<img class='thumb' alt='{esc(name)}' title='{esc(name)}' src='data:image/png;base64,{png}'>"


def completion_text(sample) -> str:
    """What the model did: its completion, or (multi-turn) every turn of its trajectory, tool calls as it wrote them,
    each tool's output or error and the environment's messages, labelled by role."""
    turns = sample.get("trajectory")
    if not isinstance(turns, list):
        return str(sample.get("completion", ""))
    return "\n".join(f"[{' '.join(str(m[k]) for k in ('role', 'name') if m.get(k))}] {m.get('content') or ''}"
                     for m in turns if isinstance(m, dict))


def _rewards(sample) -> dict:
    """A sample's reward per function (samples.jsonl may have been edited: anything else reads as none)."""
    rewards = sample.get("rewards")
    return rewards if isinstance(rewards, dict) else {}


def _reward(sample) -> float:
    return sample["reward"] if finite(sample.get("reward")) else float("-inf")


def _number_cell(value, reward: bool = False) -> str:
    if not finite(value):
        return "<td class='num note'>-</td>"
    tone = (" good" if value > 0 else " bad" if value < 0 else "") if reward else ""
    return f"<td class='num{tone}'>{value:.3g}</td>"


def config_section(runs) -> str:
    """What differs between the runs' recipes: the comparison a person otherwise makes by diffing config.yaml."""
    flat = [flatten(run.config or {}) for run in runs]
    keys = sorted({k for f in flat for k in f} - {"output_dir"})
    differing = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat}) > 1]
    if not differing:
        return "<h2>Recipes</h2><p class='note'>The runs' recipes are the same apart from output_dir.</p>"
    head = "<tr><th>recipe key</th>" + "".join(f"<th>{esc(r.name)}</th>" for r in runs) + "</tr>"
    rows = "".join(f"<tr><th>{esc(k)}</th>" + "".join(f"<td>{esc(f.get(k, '-'))}</td>" for f in flat) + "</tr>"
                   for k in differing)
    return f"<h2>What differs between the recipes</h2><table>{head}{rows}</table>"


def facts_section(runs) -> str:
    """The run's facts (summary.json) and its resolved recipe (config.yaml), collapsed."""
    parts = []
    for run in runs:
        label = f" · {esc(run.name)}" if len(runs) > 1 else ""
        if run.facts:
            rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in run.facts.items())
            parts.append(f"<details><summary>Run facts{label}</summary><table>{rows}</table></details>")
        config = run.path / "config.yaml"
        if config.is_file():
            parts.append(f"<details><summary>Recipe (config.yaml){label}</summary>"
                         f"<pre style='max-height:none'>{esc(config.read_text())}</pre></details>")
    return "".join(parts)
