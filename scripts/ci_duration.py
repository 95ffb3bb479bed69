"""Record how long CI's whole run took as the README's `make test` duration (docs/ci_run.json + the README block).

    python scripts/ci_duration.py 3081 --commit 0a2dd7f --cores 2   # seconds `.ci/run` took, where
    python scripts/ci_duration.py --check                            # exit 1 when the README is not the record's

Why: the README gives one duration for `make test`, and it must be a figure a run measured, said for what it covers
(`.ci/run` on a clean clone: creating .venv with the dev, vllm and ray extras, then the whole suite; the two are not
timed apart), never a figure typed by hand (tests/unit/test_demo_table.py holds the README to the record).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_block import README, check, readme_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "ci_run.json"
BEGIN, END = "<!-- ci-duration: begin (scripts/ci_duration.py) -->", "<!-- ci-duration: end -->"


def readme_block(record: dict) -> str:
    """The README's generated lines: the duration and exactly what it covers."""
    return (f"{BEGIN}\nHow long: CI's last whole run (`.ci/run` on a clean clone: `make test EXTRAS=dev,vllm,ray`, "
            f"which creates .venv, installs\nthe extras, then runs the whole suite; the install and the tests are not "
            f"timed apart) took {record['seconds'] / 60:.1f} min\n({record['seconds']} s) on a {record['cores']}-core "
            f"machine, at {record['commit']}. `python scripts/ci_duration.py SECONDS --commit C --cores N` records a "
            f"new one.\n{END}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", nargs="?", type=int, help="wall seconds the whole .ci/run took")
    parser.add_argument("--commit", help="the commit it ran at")
    parser.add_argument("--cores", type=int, help="CPU cores of the machine it ran on")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        return check(RECORD, readme_block, BEGIN, END, "python scripts/ci_duration.py SECONDS --commit C --cores N")
    if args.seconds is None or not args.commit or not args.cores:
        parser.error("give the seconds, --commit and --cores (or --check)")
    record = {"seconds": args.seconds, "commit": args.commit, "cores": args.cores, "what": ".ci/run"}
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    README.write_text(readme_text(BEGIN, END, readme_block(record)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
