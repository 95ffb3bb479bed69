"""report.html: what a run did, on one self-contained page (inline CSS, charts as base64 PNGs; open it from disk).

    posttrain report runs/grpo                          # redraw runs/grpo/report.html from the run's files
    posttrain report runs/a runs/b --out compare.html   # overlay several runs on one comparison page

Read from a run directory: metrics.jsonl, config.yaml, summary.json (the run's facts, written at the end of a run)
and samples.jsonl (GRPO / PPO, algo.log_samples); `render` lays the page out top to bottom.
"""

from __future__ import annotations

import fnmatch
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from posttrain.errors import UserError
from posttrain.rundir.metrics import finite, read_rows
from posttrain.report.charts import COLORS, LINESTYLES, Series, draw, is_constant
from posttrain.report.files import read_mapping, report_path
from posttrain.report.html import (config_section, constants_table, esc, facts_section, fmt, headline_single,
                                   headline_table, page, samples_section)

# train.eval_pass_k: the held-out greedy accuracy and the unbiased pass@k of each k on one chart
PASS_AT_K = ("held-out accuracy (greedy) and pass@k (sampled)", ("eval/accuracy", "eval/pass_at_?", "eval/pass_at_??",
                                                                  "eval/pass_at_???"))
# where an engine samples apart from the trainer (vllm, server): how far its log-probs are (online/mismatch.py)
MISMATCH = ("trainer vs engine log-probs", ("mismatch/logprob_diff/mean", "mismatch/logprob_diff/p99", "mismatch/k3",
                                             "mismatch/phantom_clip_fraction"))
# The curves a person reads first, per command: (title, metric patterns); eval/<metric> joins its train metric
KEY_CURVES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "sft": (("loss", ("loss",)), ("mean token accuracy", ("mean_token_accuracy",)),
            ("mean token log-prob", ("mean_token_logprob",))),
    "rm": (("loss", ("loss",)), ("accuracy (chosen scored higher)", ("accuracy",)), ("margin", ("margin",)),
           ("scores", ("rewards/chosen", "rewards/rejected"))),
    "dpo": (("loss", ("loss",)), ("reward accuracy", ("rewards/accuracies",)),
            ("reward margin", ("rewards/margins",)), ("implicit rewards", ("rewards/chosen", "rewards/rejected")),
            ("log-probs", ("logps/chosen", "logps/rejected"))),
    "grpo": (("reward", ("reward/mean",)), PASS_AT_K, ("KL to the reference", ("kl",)), ("entropy", ("entropy",)),
             ("clip fraction", ("clip_fraction",)), ("loss", ("loss",)),
             ("completion length", ("completion_length/mean",)), MISMATCH),
    "ppo": (("reward", ("reward/mean",)), PASS_AT_K, ("KL to the reference", ("kl",)), ("entropy", ("entropy",)),
            ("clip fraction", ("clip_fraction", "value_clip_fraction")), ("policy loss", ("loss",)),
            ("value loss", ("loss/critic",)), ("completion length", ("completion_length/mean",)), MISMATCH),
}
THROUGHPUT = (("tokens per second", ("tokens_per_second",)),
              ("peak memory (MB)", ("peak_memory_mb", "peak_memory_mb/rank*", "estimated_peak_memory_mb")),
              ("seconds per step, by phase", ("time/*",)))
# On a CPU the measured peak is the process's resident memory (interpreter and libraries included, ~0.6 GB) while the
# planner estimates what torch allocates: not comparable, so the estimate is left to the values table there
CPU_MEMORY = ("peak resident memory of the process (MB)", ("peak_memory_mb", "peak_memory_mb/rank*"))
EVAL_OF = {"reward/mean": "eval/reward", "completion_length/mean": "eval/completion_length"}  # else eval/<key>
COMMAND_MARKERS = (("ppo", "loss/critic"), ("grpo", "reward/mean"), ("dpo", "rewards/margins"), ("rm", "margin"))


@dataclass
class Run:
    """One run directory, read."""

    path: Path
    name: str
    command: str
    facts: dict
    config: dict
    rows: list[dict]
    samples: list[dict] = field(default_factory=list)

    def points(self, key: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
        pairs = [(r["step"], float(r[key])) for r in self.rows if finite(r.get(key))]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)

    def keys(self) -> set[str]:
        return {k for r in self.rows for k, v in r.items() if k != "step" and finite(v)}

    def last_step(self) -> int:
        return max((r.get("step", 0) for r in self.rows), default=0)


@dataclass(frozen=True)
class Chart:
    title: str
    keys: tuple[str, ...]  # train metrics first, then the eval ones that join them


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not (path / "metrics.jsonl").is_file():
        raise UserError(f"{path} is not a run directory (no metrics.jsonl there); pass the output_dir of a "
                        "posttrain run")
    facts = read_mapping(path / "summary.json", "JSON")
    config = read_mapping(path / "config.yaml", "YAML")
    rows = read_rows(path / "metrics.jsonl", needs_step=True)
    samples = read_rows(path / "samples.jsonl", needs_step=False)
    keys = {k for r in rows for k in r}
    command = str(facts.get("command") or next((c for c, marker in COMMAND_MARKERS if marker in keys), "sft"))
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    name = str(train.get("run_name") or path.resolve().name)
    return Run(path, name, command, facts, config, rows, samples)


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Several runs, each named apart: folders of the same name (a/grpo, b/grpo) get their parent's name too."""
    runs = [load_run(path) for path in paths]
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
    return runs


def constant_keys(runs: list[Run]) -> set[str]:
    """Metrics logged once or never moving, in every run: values in a table, not dots on empty axes."""
    keys = set().union(*(run.keys() for run in runs))
    return {k for k in keys if all(is_constant(list(run.points(k)[1])) for run in runs)}


def eval_key(key: str) -> str:
    return EVAL_OF.get(key, f"eval/{key}")


def plan_charts(commands: list[str], keys: set[str], constants: set[str],
                on_cpu: bool = False) -> tuple[list[Chart], ...]:
    """(the key curves, throughput and memory, the rest): every metric in one chart at most, each train metric with
    its eval counterpart, and no chart whose every line is constant. commands: one per run; with several runs the
    phase timings get a chart each (among the rest), as runs x phases would be too many lines for one. on_cpu: a
    run measured on a CPU (see CPU_MEMORY)."""
    claimed: set[str] = set()

    def take(title: str, patterns: tuple[str, ...]) -> Optional[Chart]:
        train = list(dict.fromkeys(k for p in patterns for k in sorted(keys) if fnmatch.fnmatchcase(k, p)
                                   and k not in claimed))
        members = tuple(train + [eval_key(k) for k in train if eval_key(k) in keys])
        claimed.update(members)
        return Chart(title, members) if any(k not in constants for k in members) else None

    sampled = any(k.startswith("eval/pass_at_") for k in keys)  # else eval/accuracy is a held-out chart of its own
    table = [entry for command in dict.fromkeys(commands) for entry in KEY_CURVES.get(command, ())
             if entry is not PASS_AT_K or sampled]
    key = [take(title, patterns) for title, patterns in table]
    joined = {eval_key(k) for k in keys if not k.startswith("eval/")}
    # a held-out figure with no train counterpart (GRPO's eval/accuracy) goes right after the first chart
    held_out = [take("held-out " + k[len("eval/"):], (k,)) for k in sorted(keys) if k.startswith("eval/")
                and k not in joined]
    key = key[:1] + held_out + key[1:]
    throughput = [take(*(CPU_MEMORY if on_cpu and "peak_memory_mb" in patterns else (title, patterns)))
                  for title, patterns in THROUGHPUT if len(commands) == 1 or "time/*" not in patterns]
    rest = [take(k, (k,)) for k in sorted(keys) if k not in claimed and not k.startswith("eval/")]
    rest += [take(k, (k,)) for k in sorted(keys) if k not in claimed]
    return tuple([c for c in charts if c is not None] for charts in (key, throughput, rest))


def chart_series(chart: Chart, runs: list[Run]) -> list[Series]:
    """A chart's lines: for one run a colour per metric; for several a colour per run and a line style per metric."""
    series = []
    train_keys = [k for k in chart.keys if not k.startswith("eval/")]
    for r, run in enumerate(runs):
        for i, key in enumerate(chart.keys):
            steps, values = run.points(key)
            if not steps:
                continue
            evaluated = key.startswith("eval/")
            if len(runs) == 1:
                series.append(Series(key, steps, values, COLORS[i % len(COLORS)], evaluated))
                continue
            style = LINESTYLES[(train_keys.index(key) if key in train_keys else i) % len(LINESTYLES)]
            label = run.name if len(chart.keys) == 1 else f"{run.name} · {key}"
            series.append(Series(label, steps, values, COLORS[r % len(COLORS)], evaluated, style))
    return series


def chart_image(chart: Chart, runs: list[Run], max_step: int) -> str:
    png = draw(chart.title, chart_series(chart, runs), max_step)
    return f"<figure><img alt='{html.escape(chart.title)}' src='data:image/png;base64,{png}'></figure>"


def direction(key: str) -> int:
    """+1 where higher is better, -1 where lower is, 0 where neither (lengths, timings): picks the best value."""
    name = key[len("eval/"):] if key.startswith("eval/") else key
    if "loss" in name or name in ("kl", "approx_kl"):
        return -1
    if (name.endswith(("accuracy", "accuracies", "margin", "margins")) or name.startswith("pass_at_")
            or name in ("reward", "reward/mean", "mean_token_logprob")
            or (name.startswith("rewards/") and name.endswith("/mean"))):
        return 1
    return 0


@dataclass(frozen=True)
class Figure:
    """One metric for the headline: its first, last and best (step, value); best is None where neither way is."""

    key: str
    first: tuple[int, float]
    last: tuple[int, float]
    best: Optional[tuple[int, float]]

    def detail(self) -> str:
        parts = [f"step {self.last[0]}"]
        if self.first[0] != self.last[0] and self.first[1] == self.last[1] == (self.best or self.last)[1]:
            return f"step {self.last[0]} · unchanged since step {self.first[0]}"
        if self.key.startswith("eval/") and self.first[0] != self.last[0]:
            parts.append(f"from {fmt(self.key, self.first[1])} at step {self.first[0]}")
        if self.best is not None and self.first[0] != self.last[0]:
            parts.append(f"best {fmt(self.key, self.best[1])} at step {self.best[0]}")
        return " · ".join(parts)


def figure(run: Run, key: str) -> Optional[Figure]:
    steps, values = run.points(key)
    if not steps:
        return None
    best = max(range(len(values)), key=lambda i: direction(key) * values[i]) if direction(key) else None
    return Figure(key, (steps[0], values[0]), (steps[-1], values[-1]),
                  None if best is None else (steps[best], values[best]))


def headline_figures(run: Run, key_charts: list[Chart], limit: int = 6) -> list[Figure]:
    """The algorithm's first curve (the loss; the reward for online RL, whose loss has no best), then the held-out
    metrics, those of the key curves first."""
    keys = run.keys()
    train = [k for chart in key_charts[:1] for k in chart.keys if not k.startswith("eval/") and k in keys][:1]
    in_charts = [k for chart in key_charts for k in chart.keys if k.startswith("eval/")]
    evals = list(dict.fromkeys(in_charts + sorted(k for k in keys if k.startswith("eval/"))))
    return [f for f in (figure(run, k) for k in train + evals) if f is not None][:limit]


def eval_figures(run: Run) -> list[Figure]:
    """Every held-out metric at its first evaluation (step 0: the starting model), its last and its best."""
    return [f for f in (figure(run, k) for k in sorted(run.keys()) if k.startswith("eval/")) if f is not None]


def describe(run: Run) -> str:
    """What was trained, on what, for how long, in one line (HTML: every value from the run's files escaped)."""
    model, data = (run.config.get(k) if isinstance(run.config.get(k), dict) else {} for k in ("model", "data"))
    f = run.facts
    parts = [f"<b>{esc(model.get('name_or_path', '?'))}</b> on {esc(data.get('train', '?'))}"
             + (f" (eval: {esc(data['eval'])})" if data.get("eval") else "")]
    planned = f" of {esc(f['steps'])}" if f.get("steps") and f["steps"] != run.last_step() else ""
    parts.append(f"{run.last_step()} steps{planned}")
    parts += [f"{float(f['minutes']):.1f} min"] if finite(f.get("minutes")) else []
    parts += [f"{esc(f['parameters'])} parameters"] if f.get("parameters") else []
    parts += [f"global batch {esc(f['global_batch'])}"] if f.get("global_batch") else []
    if f.get("world_size"):
        several = not finite(f["world_size"]) or f["world_size"] > 1
        parts.append(f"{esc(f['world_size'])} process{'es' if several else ''} ({esc(f.get('engine', '?'))}, "
                     f"{esc(f.get('device', '?'))})")
    return " · ".join(parts)


def write_report(output_dir: str | Path, facts: Optional[dict[str, Any]] = None) -> Path:
    """Save the run's facts (summary.json, so `posttrain report` can redraw the page) and write report.html."""
    output_dir = Path(output_dir)
    if facts is not None:
        (output_dir / "summary.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
    report = output_dir / "report.html"
    report.write_text(render([load_run(output_dir)]))
    return report


def render(runs: list[Run]) -> str:
    """The page for one run, or the comparison page for several (overlaid curves, one headline row per run)."""
    constants = constant_keys(runs)
    key_charts, throughput, rest = plan_charts([r.command for r in runs], set().union(*(r.keys() for r in runs)),
                                               constants, any(r.facts.get("device") == "cpu" for r in runs))
    max_step = max(run.last_step() for run in runs)

    def grid(charts: list[Chart]) -> str:
        return "<div class='grid'>" + "".join(chart_image(c, runs, max_step) for c in charts) + "</div>"

    if len(runs) == 1:
        run = runs[0]
        title = f"posttrain {run.command} · {run.name}"
        body = [headline_single(title, describe(run), headline_figures(run, key_charts), eval_figures(run))]
    else:
        title = f"posttrain · {len(runs)} runs compared"
        body = [headline_table(runs, title, [describe(r) for r in runs],
                               [headline_figures(r, key_charts) for r in runs])]
    body.append("<h2>Curves</h2>" + grid(key_charts) if key_charts else "")
    body.append("<h2>Throughput and memory</h2>" + grid(throughput) if throughput else "")
    body.append(constants_table(runs, sorted(constants)))
    body.append(samples_section(runs[0]) if len(runs) == 1 else config_section(runs))
    if rest:
        body.append(f"<details><summary>All other metrics ({len(rest)})</summary>{grid(rest)}</details>")
    body.append(facts_section(runs))
    return page(title, "\n".join(b for b in body if b))


def add_report(sub) -> None:
    p = sub.add_parser("report", help="redraw a run's report.html, or compare several runs on one page")
    p.add_argument("runs", nargs="+", help="run directories (a run's output_dir)")
    p.add_argument("--out", help="where to write the page (default: RUN/report.html for one run, "
                   "compare.html here for several)")


def run_report(args) -> int:
    runs = load_runs(args.runs)
    out = report_path([run.path for run in runs], args.out)
    out.write_text(render(runs))
    if len(runs) == 1 and out == runs[0].path / "report.html":  # still the run's own file
        from posttrain.rundir.attempts import record_rewritten

        record_rewritten(runs[0].path, out.name)
    print(f"report: {out}")
    return 0
