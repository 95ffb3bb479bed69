"""The `plan` and `doctor` subcommands of the command line (posttrain/cli.py adds them and calls `run_plan_or_doctor`).

    posttrain plan --config recipes/dpo.yaml --gpus 8 --gpu-memory 80GiB
    torchrun --nproc_per_node 8 -m posttrain doctor --config recipes/dpo.yaml
    posttrain doctor --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr node0    # the doctor's own ranks
    posttrain doctor runs/grpo          # a run (finished or running): is it learning? (rundir/health.py)
"""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import UserError
from posttrain.launch.doctor_ranks import add_launch_flags, run_ranks


def add_plan_and_doctor(sub) -> None:
    plan = sub.add_parser("plan", help="estimate per-GPU memory for a recipe under each engine; recommend one")
    plan.add_argument("--config", "-c", help="recipe YAML (see recipes/)")
    plan.add_argument("--algorithm", help="sft, rm, dpo or grpo (default: told by the recipe's algo: keys)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs in all (default 1)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are on (default 1)")
    plan.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GiB (default: this machine's GPU)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.add_argument("--bf16", action="store_true", help="plan bf16 autocast (train.mixed_precision=bf16), as "
                      "--bf16 on a training command")
    plan.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="plan weights stored in this "
                      "dtype (model.dtype; the shipped recipes load float32)")
    plan.add_argument("--mean-length", type=int, help="the data's mean tokens per row (prompt + completion), for "
                      "packed and token-budget micro-batches (default: every row data.max_length long, the worst case)")
    plan.add_argument("--image-tokens", type=int, help="a vision-language model: the data's image tokens per row "
                      "(default: the largest image its processor makes, at most the row: the worst case)")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. data.max_length=2048")
    doctor = sub.add_parser("doctor", help="check GPUs, versions, the process group and disk before a launch")
    doctor.add_argument("--config", "-c", help="recipe YAML: checks its output_dir's disk and that every rank has it")
    doctor.add_argument("--timeout", type=float, default=30.0, help="seconds the rendezvous may take, counted from "
                        "the process's start (imports and local checks included), and each later step of the group "
                        "check (each collective), before it fails naming what is missing (default 30)")
    doctor.add_argument("--build-ops", action="store_true", help="also compile DeepSpeed's CPU Adam (tens of s)")
    add_launch_flags(doctor)
    doctor.add_argument("overrides", nargs="*", help="key.sub=value overrides of the recipe; or one run directory "
                        "(its output_dir): the signs in its metrics.jsonl that it is not learning, each with its fix")


def run_plan_or_doctor(args) -> int:
    if args.command == "doctor":  # only what it needs: its deadline counts its own imports (doctor.process_started)
        from posttrain.launch.doctor import run_doctor

        if len(args.overrides) == 1 and "=" not in args.overrides[0]:
            return run_health(Path(args.overrides[0]))

        if args.nproc_per_node is not None:
            return run_ranks(args)
        return run_doctor(args.config, args.overrides, args.timeout, args.build_ops)
    from posttrain.algorithms import ALGORITHMS
    from posttrain.config.load import load_recipe
    from posttrain.plan import infer_algorithm, run_plan

    algorithm = args.algorithm or infer_algorithm(args.config, args.overrides)
    if algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    from posttrain.config.trl_compat import as_override, translate

    # the TRL flags a training command takes (--learning_rate 1e-5) mean the same here
    flags = [as_override(path, value) for _, path, value in
             translate(getattr(args, "trl_flags", {}), "command line", ALGORITHMS[algorithm][0], "--")]
    overrides = flags + list(args.overrides) + (["train.mixed_precision=bf16"] if args.bf16 else []) + (
        [f"model.dtype={args.dtype}"] if args.dtype else [])
    recipe = load_recipe(args.config, overrides, ALGORITHMS[algorithm][0])
    print(run_plan(algorithm, recipe, args.config, overrides, args.gpus, args.nodes, args.gpu_memory, args.json,
                   args.mean_length, args.image_tokens))
    return 0


def run_health(run_dir: Path) -> int:
    """`posttrain doctor RUN_DIR`: what the run said while it trained (rundir/health.py, over the same rows), one
    WARN line with its fix per sign. Exit status: 0 none, 1 some."""
    from posttrain.rundir.health import CHECKS, diagnose
    from posttrain.rundir.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir} is not a run directory (no metrics.jsonl there); pass a run's output_dir, or "
                        "key=value overrides with --config")
    rows = read_metrics(run_dir)
    findings = diagnose(rows)
    last = max((int(r.get("step", 0)) for r in rows), default=0)
    for f in findings:
        subject = f" ({f.subject})" if f.subject else ""
        print(f"WARN  {f.check}{subject}: step {f.step}: {f.detail}\n      fix: {f.fix}", flush=True)
    if not findings:
        print(f"PASS  run health: none of the {len(CHECKS)} signs of a run that is not learning, over {len(rows)} "
              f"rows up to step {last}", flush=True)
    return 1 if findings else 0
