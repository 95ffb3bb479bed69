"""argv -> recipe -> run.

    posttrain sft  --config recipes/sft.yaml train.max_steps=20 model.name_or_path=tiny/
    posttrain make-tiny-model --out tiny/
    posttrain demo
    posttrain report runs/sft [runs/other ...]

Exit codes: 0 done; 2 the input is wrong (the message says what, where and what to do); 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def build_parser() -> argparse.ArgumentParser:
    from posttrain.algorithms import ALGORITHMS

    parser = argparse.ArgumentParser(prog="posttrain", description="Post-training for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ALGORITHMS:
        p = sub.add_parser(name, help=f"train with {name}")
        p.add_argument("--config", "-c", help="recipe YAML (see recipes/)")
        p.add_argument("--ray", action="store_true", help="run under Ray, placed by the recipe's placement: "
                       "(the same as launcher=ray; docs/ray.md)")
        p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.max_steps=20")
    tiny = sub.add_parser("make-tiny-model", help="write a small random model + locally trained tokenizer")
    tiny.add_argument("--out", required=True, help="directory to write")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    tiny.add_argument("--seed", type=int, default=0)
    demo = sub.add_parser("demo", help="tiny model, synthetic arithmetic task, SFT -> DPO -> GRPO on CPU")
    demo.add_argument("--out", default="runs/demo", help="where the demo writes its runs")
    demo.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    demo.add_argument("--seed", type=int, default=0, help="model initialisation, problems drawn and run seeds")
    from posttrain.launch.commands import add_plan_and_doctor

    add_plan_and_doctor(sub)
    from posttrain.rollout.serve import add_serve

    add_serve(sub)
    from posttrain.report import add_report

    add_report(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = run_command(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A launched worker leaves without interpreter teardown: there, gloo's worker threads can abort a finished,
        # successful process ("terminate called without an active exception"). Everything is written and closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_command(argv: list[str] | None = None) -> int:
    from posttrain.errors import RunStopped, UserError
    from posttrain.usercode import UserCodeError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "make-tiny-model":
            from posttrain.models.tiny import make_tiny_model

            path = make_tiny_model(args.out, arch=args.arch, seed=args.seed)
            print(f"wrote {path}")
            return 0
        if args.command == "demo":
            from posttrain.demo import run_demo

            run_demo(args.out, quick=args.quick, seed=args.seed)
            return 0
        if args.command == "serve":
            from posttrain.rollout.serve import run_serve

            return run_serve(args)
        if args.command == "report":
            from posttrain.report import run_report

            return run_report(args)
        if args.command in ("plan", "doctor"):
            from posttrain.launch.commands import run_plan_or_doctor

            return run_plan_or_doctor(args)
        from posttrain.algorithms import ALGORITHMS
        from posttrain.config.load import load_recipe
        from posttrain.run import run

        overrides = args.overrides + (["launcher=ray"] if args.ray else [])
        recipe = load_recipe(args.config, overrides, ALGORITHMS[args.command][0])
        if recipe.launcher == "ray":
            from posttrain.launch.ray_launcher import run_on_ray

            return run_on_ray(args.command, recipe)
        result = run(args.command, recipe)
        if result.final_dir is not None:
            print(f"final model: {result.final_dir}")
        return 0
    except UserError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:  # on purpose, work saved: one line (from rank 0 when every rank stops alike)
        if not e.shared or os.environ.get("RANK", "0") == "0":
            rank = os.environ.get("RANK")
            where = f" (rank {rank})" if rank is not None and not e.shared else ""
            print(f"posttrain: {'error' if e.exit_code == 1 else 'stopped'}{where}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except UserCodeError as e:  # a reward (tool, environment) failed: its message, then the user's own traceback
        print(f"posttrain: error: {e}\n{e.user_traceback}".rstrip(), file=sys.stderr, flush=True)
        abort_process_group()
        return e.exit_code
    except SystemExit as e:  # something the run called ended it: never exit 0 for a run that did not finish
        print(f"posttrain: error: posttrain {args.command} was ended by sys.exit({e.code!r}) before it finished "
              "(called by code it ran: a reward, a tool, a library); nothing after that point ran", file=sys.stderr,
              flush=True)
        abort_process_group()
        return e.code if isinstance(e.code, int) and e.code != 0 else 1
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 1
    except Exception:  # the user sees the real error (and which rank) instead of a hang
        rank = os.environ.get("RANK")
        where = f" on rank {rank}" if rank is not None else ""
        lost = lost_peers()
        if lost:  # a peer died (kill -9, out of memory, node loss): that is the news, not this rank's traceback
            print(f"posttrain: error (rank {rank}): lost rank {', '.join(map(str, lost))}: its process ended "
                  "(killed or crashed), so this rank stops too. Checkpoints already saved are complete; continue "
                  "with train.resume_from_checkpoint=auto", file=sys.stderr, flush=True)
            abort_process_group()
            return 1
        print(f"posttrain: failed{where}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        abort_process_group()
        return 1


def lost_peers() -> list[int]:
    try:
        from posttrain.distributed.peers import lost_ranks

        return lost_ranks()
    except Exception:
        return []


def abort_process_group() -> None:
    """Tear the process group down so peers blocked in a collective fail fast instead of waiting for the timeout."""
    try:
        from posttrain.distributed.backend import abort

        abort()
    except Exception:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
