"""argv -> recipe -> run.

    posttrain sft  --config recipes/sft.yaml train.max_steps=20 model.name_or_path=tiny/
    posttrain make-tiny-model --out tiny/
    posttrain demo
    posttrain report runs/sft [runs/other ...]

Exit codes: 0 done; 2 the input is wrong (the message says what, where and what to do); 1 anything else.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import traceback

from posttrain.console import no_library_bars_without_a_terminal, quiet_healthy_run_warnings
from posttrain.errors import RunStopped, UserError
from posttrain.usercode import UserCodeError

# The commands, listed without importing what runs them (torch, the planner, vLLM): `posttrain --help` stays fast.
PLAN_OPTIONS = {"config": True, "algorithm": True, "gpus": True, "nodes": True, "gpu_memory": True, "json": False,
                "bf16": False, "dtype": True, "mean_length": True, "image_tokens": True, "help": False}
"""`posttrain plan`'s own options (name -> takes a value); any other --flag is a training command's (launch/commands.py)."""
ALGORITHM_COMMANDS = ("sft", "grpo", "rm", "dpo", "ppo", "distill")  # posttrain.algorithms.ALGORITHMS (a test keeps them equal)
OTHER_COMMANDS = {  # command -> (its one-line help, its module, the functions there that add its options and run it)
    "plan": ("estimate per-GPU memory for a recipe under each engine; recommend one",
             "posttrain.launch.commands", "add_plan_and_doctor", "run_plan_or_doctor"),
    "doctor": ("check GPUs, versions, the process group and disk before a launch",
               "posttrain.launch.commands", "add_plan_and_doctor", "run_plan_or_doctor"),
    "serve": ("start a vLLM generation server for generation.placement=servers", "posttrain.generation.serve",
              "add_serve", "run_serve"),
    "report": ("redraw a run's report.html, or compare several runs on one page", "posttrain.report.write",
               "add_report", "run_report"),
}
ALGORITHM_EPILOG = """TRL-style flags work too: --learning_rate 1e-4, --num_generations=4, --bf16 (docs/trl.md has
the table), and --config takes a flat TRL config file (model_name_or_path: ..., learning_rate: ...). A run given
in TRL's words (TRL flags without a posttrain recipe, or a flat TRL config) takes TRL 1.16's defaults for what it
leaves out, not the defaults below; its first line names them. Online algorithms take TRL's reward functions:
--reward_funcs my_rewards.py:accuracy pkg.module.fn runs/rm/final --reward_weights 1 0.5 0.2 (docs/rewards.md).

Recipe keys (key = default  # what it does); set any with key.sub=value:
"""


def build_parser(command: str | None = None, help_wanted: bool = False) -> argparse.ArgumentParser:
    """The command line; only `command`'s own options import anything beyond argparse (its recipe keys, listed by
    its --help, only when help is asked for)."""
    parser = argparse.ArgumentParser(prog="posttrain", description="Post-training for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ALGORITHM_COMMANDS:
        epilog = None
        if name == command and help_wanted:
            from posttrain.algorithms import ALGORITHMS
            from posttrain.config.keys import format_keys

            epilog = ALGORITHM_EPILOG + format_keys(ALGORITHMS[name][0])
        p = sub.add_parser(name, help=f"train with {name}", epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", "-c", help="recipe YAML (see recipes/), or a flat TRL config file")
        p.add_argument("--ray", action="store_true", help="run under Ray, placed by the recipe's placement: "
                       "(the same as launcher=ray; docs/ray.md)")
        p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.max_steps=20")
    tiny = sub.add_parser("make-tiny-model", help="write a small random model + locally trained tokenizer")
    tiny.add_argument("--out", required=True, help="directory to write")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3_moe", "qwen2_vl", "llava"],
                      help="qwen3_moe: a mixture-of-experts model (4 experts, 2 per token); qwen2_vl, llava: a "
                      "vision-language model with its processor (docs/vision.md)")
    tiny.add_argument("--seed", type=int, default=0)
    demo = sub.add_parser("demo", help="tiny model, synthetic arithmetic task, SFT -> DPO -> GRPO and PPO on CPU "
                          "(6-10 minutes on 2 CPU cores)")
    demo.add_argument("--out", default="runs/demo", help="where the demo writes its runs")
    demo.add_argument("--quick", action="store_true", help="a smoke run of every stage (about 30 s of CPU, up to 4 "
                      "minutes on 2 busy cores); it checks the pipeline runs and learns nothing, so its accuracies "
                      "are near 0")
    demo.add_argument("--seed", type=int, default=0, help="model initialisation, problems drawn and run seeds")
    if command in OTHER_COMMANDS:
        _, module, function, _ = OTHER_COMMANDS[command]
        getattr(importlib.import_module(module), function)(sub)
    for name, (help_text, *_) in OTHER_COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parser.parse_args, with `key=value` overrides anywhere among the flags (argparse takes a positional list in one
    run: `posttrain plan --config r.yaml a=1 --gpus 2 b=2` would refuse b=2)."""
    args, unknown = parser.parse_known_args(argv)
    overrides = [a for a in unknown if "=" in a and not a.startswith("-")]
    if len(overrides) != len(unknown) or not hasattr(args, "overrides"):
        return parser.parse_args(argv)  # argparse's own message for what is not an override
    args.overrides = [*(args.overrides or []), *overrides]
    return args


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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_healthy_run_warnings()
    no_library_bars_without_a_terminal()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    argv_given = list(argv)
    trl_flags: dict = {}
    if command in ALGORITHM_COMMANDS or command == "plan":  # plan reads a training command's recipe flags too
        from posttrain.config.trl_compat import check_flags_early
        from posttrain.config.trl_flags import split_trl_flags

        try:
            argv, trl_flags = split_trl_flags(argv, PLAN_OPTIONS if command == "plan" else None)
            if command != "plan":
                check_flags_early(trl_flags, command)  # before torch: a typo is refused in a second, not twenty
        except UserError as e:
            print(f"posttrain: error: {e}", file=sys.stderr)
            return 2
    args = parse_args(build_parser(command, help_wanted=bool({"-h", "--help"} & set(argv))), argv)
    args.trl_flags = trl_flags
    if args.command in ALGORITHM_COMMANDS or args.command == "demo":
        one_thread_unless_asked()
    try:
        if args.command == "make-tiny-model":
            from posttrain.models.tiny import make_tiny_model
            from posttrain.models.tiny_vision import VISION_ARCHS, make_tiny_vlm

            make = make_tiny_vlm if args.arch in VISION_ARCHS else make_tiny_model
            print(f"wrote {make(args.out, arch=args.arch, seed=args.seed)}")
            return 0
        if args.command == "demo":
            from posttrain.demo import run_demo

            run_demo(args.out, quick=args.quick, seed=args.seed)
            return 0
        if args.command in OTHER_COMMANDS:
            _, module, _, function = OTHER_COMMANDS[args.command]
            return getattr(importlib.import_module(module), function)(args)
        from posttrain.algorithms import ALGORITHMS
        from posttrain.config.load import resolve_recipe
        from posttrain.rundir.claim import forget_started
        from posttrain.run import run

        forget_started()
        algo_cls = ALGORITHMS[args.command][0]
        overrides = command_line_overrides(args.overrides, trl_flags, algo_cls) + (["launcher=ray"] if args.ray else [])
        recipe, trl_defaults = resolve_recipe(args.config, overrides, algo_cls, trl_flags)
        header = {}
        if trl_defaults or (trl_flags and not args.config):
            from posttrain.config.trl_compat import say_trl_defaults, whose_defaults

            say_trl_defaults(algo_cls, trl_defaults, recipe.model.lora.enabled)
            header["defaults"] = whose_defaults(algo_cls)
        if recipe.launcher == "ray":
            from posttrain.launch.ray_launcher import run_on_ray

            return run_on_ray(args.command, recipe)
        result = run(args.command, recipe, header=header)
        if result.final_dir is not None:
            print(f"final model: {result.final_dir}")
        return 0
    except UserError as e:
        from posttrain.rundir.claim import run_started

        started = run_started() if args.command in ALGORITHM_COMMANDS else None  # demo: its own runs' directories
        if started is not None:  # exit 2 says nothing was written: this one was found once the run had begun
            print(f"posttrain: error: {e}\n(found once the run had started writing in {started}: exit 1; a plain "
                  "rerun there is allowed while it holds no trained step)", file=sys.stderr)
            return 1
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:  # on purpose, work saved: one line (from rank 0 when every rank stops alike)
        if e.resumable and args.command in ALGORITHM_COMMANDS:
            e.continue_with = f"`{continue_command(argv_given, recipe.train.overwrite_output_dir)}`"
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
        else:
            print(f"posttrain: failed{where}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        abort_process_group()
        return 1


def continue_command(argv: list[str], overwrite: bool) -> str:
    """The command that continues a stopped run: the one given, without what set overwrite_output_dir or
    resume_from_checkpoint, plus train.resume_from_checkpoint=auto (and overwrite_output_dir=false where the recipe
    file sets it true: the two conflict). Under a launcher (torchrun, accelerate launch) its arguments, to relaunch."""
    from posttrain.config.trl_flags import split_trl_flag_texts

    replaced = ("overwrite_output_dir", "resume_from_checkpoint")
    rest, flags, typed = split_trl_flag_texts(argv)
    kept = [a for a in rest if not a.startswith(tuple(f"train.{key}=" for key in replaced))]
    overwrite_given = "overwrite_output_dir" in flags or "train.overwrite_output_dir=" in " ".join(rest)
    for key in flags:  # as typed: --reward_funcs a.py:f b.py:g, never a quoted Python list
        if key not in replaced:
            kept += [f"--{key}", *typed[key]]
    kept.append("train.resume_from_checkpoint=auto")
    if overwrite and not overwrite_given:
        kept.append("train.overwrite_output_dir=false")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return ("<the same launcher> -m posttrain " if launched else "posttrain ") + shlex.join(kept)


def one_thread_unless_asked() -> None:
    """One torch thread per process unless the user set a count (OMP_NUM_THREADS): torchrun and accelerate launch
    already do this for their workers. A lone process with torch's default (every core) ran a tiny model's step 25x
    slower on busy cores (0.72 s against 0.028 s, the same losses)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # read by torch when it is first imported (and by the processes it starts)
    if "torch" in sys.modules:  # called in-process after torch started (a notebook, the tests)
        sys.modules["torch"].set_num_threads(1)


def command_line_overrides(overrides: list[str], trl_flags: dict, algo_cls: type) -> list[str]:
    """TRL-style flags translated to overrides, then the typed overrides, each checked on its own so that an error
    names the command line and echoes what was typed (not the recipe file the value would land in). A bare word for
    a string key stays that word (train.mixed_precision=no is 'no', not YAML's false)."""
    from posttrain.config.trl_compat import as_override, translate
    from posttrain.config.trl_rewards import REWARD_KEYS

    checked, by_path = [], {}
    for key, path, value in translate(trl_flags, "command line", algo_cls, "--"):  # every bad flag at once
        if path == "rewards":  # one list, made together from every reward flag given
            typed = " ".join(f"--{k} {v}" for k, v in trl_flags.items() if k in REWARD_KEYS)
        else:
            typed = f"--{key} {trl_flags[key]}"
        checked.append(checked_override(as_override(path, value), typed, algo_cls))
        by_path[path] = typed
    for item in overrides:
        path = item.partition("=")[0].strip()
        if path in by_path:
            raise UserError(f"command line: {by_path[path]} and {item} both set {path}; keep one")
    return checked + [checked_override(item, item, algo_cls) for item in overrides]


def checked_override(item: str, typed: str, algo_cls: type) -> str:
    """`item` if it builds alone; else the same word quoted where that builds (a string key given no/yes/null);
    else the error, naming the command line and what was typed."""
    from posttrain.config.legacy import upgrade
    from posttrain.config.load import apply_override, build
    from posttrain.config.schema import Recipe

    def check(text: str) -> None:
        raw: dict = {}
        apply_override(raw, text)
        upgrade(raw, say=False)  # an earlier release's spelling is read as today's key (said once, by load_recipe)
        build(Recipe, {**raw, "algo": raw.get("algo", {})}, f"command line '{typed}'", "", algo_cls)

    try:
        check(item)
        return item
    except UserError as error:
        key, _, value = item.partition("=")
        if value and value.isalpha():
            quoted = f"{key}='{value}'"
            try:
                check(quoted)
                return quoted
            except UserError:
                pass
        raise error from None


def lost_peers() -> list[int]:
    try:
        from posttrain.distributed.peers import lost_ranks

        return lost_ranks()
    except Exception:
        return []


def abort_process_group() -> None:
    """Tear the process group down so peers blocked in a collective fail fast instead of waiting for the timeout."""
    try:
        from posttrain.distributed.process_exit import abort

        abort()
    except Exception:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
