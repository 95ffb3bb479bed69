"""Record a `posttrain demo` run as the README's demo table (docs/demo_results.json + the README block).

    python scripts/demo_table.py runs/demo/demo_results.json [--where "CI, 2 cores"] [--cores 2]
    python scripts/demo_table.py --check     # exit 1 when the README's table is not docs/demo_results.json's

Why: the README's figures must be what a run printed, and move when the demo does (tests/unit/test_demo_table.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from posttrain.demo.table import BEGIN, END, readme_block  # noqa: E402
from readme_block import README, check, readme_text as readme_block_text  # noqa: E402

RECORD = ROOT / "docs" / "demo_results.json"
KEYS = ("seed", "held_out_prompts", "minutes", "sft_accuracy", "dpo_pref_accuracy_before", "dpo_pref_accuracy_after",
        "dpo_accuracy", "grpo_accuracy", "ppo_accuracy")


def readme_text(record: dict) -> str:
    return readme_block_text(BEGIN, END, readme_block(record))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", help="a demo's demo_results.json (a full run, not --quick)")
    parser.add_argument("--where", help="where it ran (default: this checkout's commit)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU cores it ran on")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        return check(RECORD, readme_block, BEGIN, END, "python scripts/demo_table.py")
    if not args.results:
        parser.error("give a demo_results.json, or --check")
    results = json.loads(Path(args.results).read_text())
    if results.get("held_out_prompts", 0) < 200:
        parser.error(f"{args.results} is a --quick run (held_out_prompts {results.get('held_out_prompts')}): its "
                     "figures say only that every stage ran")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    record = {key: results[key] for key in KEYS}
    record["measured"] = {"date": datetime.date.today().isoformat(), "where": args.where or f"at {commit.strip()}",
                          "cores": args.cores}
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    README.write_text(readme_text(record))
    print(f"wrote {RECORD.relative_to(ROOT)} and the table in {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
