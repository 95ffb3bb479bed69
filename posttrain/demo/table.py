"""The README's demo table, rendered from a demo's results (demo_results.json), so the figures the README shows are
the ones a run printed, never typed by hand.

    posttrain demo                                           # ends with `README row: | 0 | 59.0% | ...`
    python scripts/demo_table.py runs/demo/demo_results.json # records them in docs/demo_results.json, rewrites README

tests/unit/test_demo_table.py holds the README's table to docs/demo_results.json; the quick demo's test holds the row
the demo prints to this renderer.
"""

from __future__ import annotations

from typing import Any

BEGIN, END = "<!-- demo-table: begin (scripts/demo_table.py) -->", "<!-- demo-table: end -->"
HEAD = ("| seed | SFT exact match | preference accuracy before -> after DPO | exact match after DPO "
        "| after GRPO (from SFT) | after PPO (from SFT) |\n|---|---|---|---|---|---|")


def readme_row(results: dict[str, Any]) -> str:
    """One demo run's row of the README table (accuracies on its held-out problems)."""
    r = results
    return (f"| {r['seed']} | {r['sft_accuracy']:.1%} | {r['dpo_pref_accuracy_before']:.1%} -> "
            f"{r['dpo_pref_accuracy_after']:.1%} | {r['dpo_accuracy']:.1%} | {r['grpo_accuracy']:.1%} "
            f"| {r['ppo_accuracy']:.1%} |")


def readme_block(record: dict[str, Any]) -> str:
    """The README's generated block: where the figures come from, then the table (docs/demo_results.json's shape:
    the demo's results plus `measured`, where and when the run was)."""
    m = record["measured"]
    return (f"{BEGIN}\nWhat `posttrain demo` printed on {m['date']} ({m['where']}, seed {record['seed']}, "
            f"{record['held_out_prompts']} held-out problems; the whole demo in {record['minutes']:.1f} min on "
            f"{m['cores']} CPU cores). `python scripts/demo_table.py runs/demo/demo_results.json` records a new run "
            f"here:\n\n{HEAD}\n{readme_row(record)}\n{END}")
