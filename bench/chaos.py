"""Chaos: kill -9 a run at random moments, resume it with `auto`, and compare it with an uninterrupted run.

    .venv/bin/python bench/chaos.py --algo sft --kills 20
    .venv/bin/python bench/chaos.py --algo grpo --kills 20
    .venv/bin/python bench/chaos.py --algo sft --engine zero3 --kills 20    # 2 processes; some kills hit one rank
    .venv/bin/python bench/chaos.py --kills 2 --steps 4 --kinds checkpoint,export   # what CI runs (tests/)

Each kill is drawn from: a random moment of the run, during a checkpoint write (a .tmp-step-N directory exists),
during the export (.tmp-final exists), and with 2 processes, one rank of the two (the other must then stop by itself
within --stop-bound seconds, saying which rank was lost). After a kill every checkpoint must still match its
manifest, and the run restarts with train.resume_from_checkpoint=auto. When a run finishes, its final weights are
compared with the reference run's; while kills remain a new episode starts in a fresh output_dir.
Failures: a restart that fails by itself, a checkpoint left corrupt, a lone rank that does not stop in time or does
not name the lost rank, a start that runs longer than --hang-factor x the reference run (a hang: after a kill -9
during start-up, torch's JIT build lock of DeepSpeed's CPU ops can be left behind, see docs/reliability.md), final
weights further than --tol from the reference. Prints one line per event, then
kills / resumes / failures / max |dw| and the same as one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.rundir.files import verify  # noqa: E402

ENGINES = {"single": None, "ddp": "ddp", "zero2": "zero2", "zero3": "zero3", "fsdp2": "fsdp2"}


def overrides(args, data: dict, model: Path, out: Path) -> list[str]:
    world = 1 if args.engine == "single" else 2
    common = [f"model.name_or_path={model}", f"output_dir={out}", f"train.max_steps={args.steps}",
              "train.save_steps=2", "train.logging_steps=1", "train.report=false", "train.tensorboard=false",
              "train.resume_from_checkpoint=auto", "seed=3", "train.ddp_timeout=60"]
    if args.algo == "sft":
        return common + [f"data.train={data['sft_train']}", f"train.per_device_train_batch_size={4 // world}",
                         "train.learning_rate=3e-3"]
    return common + [f"data.train={data['prompts_train']}", f"train.per_device_train_batch_size={8 // world}",
                     "algo.num_generations=4", "generation.max_completion_length=8", "rewards=[{name: length_penalty, kwargs: {max_length: 40}}]",
                     "train.learning_rate=1e-3"]


def argv(args, data: dict, model: Path, out: Path) -> list[str]:
    program = ["-m", "posttrain", args.algo] + overrides(args, data, model, out)
    if args.engine == "single":
        return [sys.executable] + program
    if args.engine == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(random.Random().randint(20000, 40000))] + program
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
            str(ROOT / "recipes" / "accelerate" / f"{args.engine}.yaml"), "--num_processes", "2", "--num_machines",
            "1", "--main_process_port", str(random.Random().randint(20000, 40000))] + program


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    out.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT))
    out.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "posttrain" / "torch_extensions"))
    return out


def descendants(root: int) -> list[int]:
    """Every process below `root` (Linux /proc). torchrun starts each worker in a session of its own, so killing
    the launcher's process group would leave the workers running as orphans."""
    parent = {}
    for entry in Path("/proc").iterdir():
        try:
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def kill_all(proc: subprocess.Popen) -> None:
    """kill -9 the launcher and every process it started (a job killed by the scheduler, a lost machine)."""
    for pid in [proc.pid] + descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def worker_pid(launcher: int, rank: int) -> int | None:
    """The training process of `rank` among the processes the launcher started."""
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and f"LOCAL_RANK={rank}".encode() in environ:
            return pid
    return None


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def max_dw(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def training(log: Path) -> bool:
    """This start of the run has logged a step (the last section of its log shows one)."""
    text = log.read_text(errors="replace")
    return re.search(r"^step \d+/", text[text.rfind("--- start"):], re.M) is not None


def saving(out: Path) -> bool:
    return any((out / "checkpoints").glob(".tmp-step-*"))


def exporting(out: Path) -> bool:
    return (out / ".tmp-final").exists()


class Chaos:
    def __init__(self, args, data: dict, model: Path, root: Path):
        self.args, self.data, self.model, self.root = args, data, model, root
        self.rng = random.Random(args.seed)
        self.kills, self.resumes, self.failures, self.episodes = 0, 0, [], 0
        self.kinds: dict[str, int] = {}
        self.max_dw = 0.0
        self.run_seconds = 60.0

    def start(self, out: Path, log: Path) -> subprocess.Popen:
        with log.open("a") as f:
            return subprocess.Popen(argv(self.args, self.data, self.model, out), cwd=ROOT, env=env(), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def reference(self) -> dict:
        out = self.root / "reference"
        started = time.perf_counter()
        proc = self.start(out, self.root / "reference.log")
        if proc.wait() != 0:
            raise SystemExit(f"the reference run failed:\n{(self.root / 'reference.log').read_text()[-4000:]}")
        self.run_seconds = time.perf_counter() - started
        print(f"reference: {self.run_seconds:.0f} s", flush=True)
        return final_weights(out)

    def kill_once(self, proc: subprocess.Popen, out: Path, log: Path) -> str | None:
        """Wait for the moment of the drawn kind and kill; None when the run ended first."""
        kinds = ["random", "checkpoint", "export"] + (["rank"] * 2 if self.args.engine != "single" else [])
        kind = self.args.kinds[self.kills % len(self.args.kinds)] if self.args.kinds else self.rng.choice(kinds)
        # a rank is killed once training has begun (a kill during start-up is the launcher's business: it stops the
        # other ranks), a random kill anywhere
        delay = {"random": self.rng.uniform(0.2, 0.9) * self.run_seconds, "rank": self.rng.uniform(0, 3)}
        deadline = time.perf_counter() + delay.get(kind, 10 * self.run_seconds)
        started_training = None
        hung_at = time.perf_counter() + self.args.hang_factor * self.run_seconds
        while proc.poll() is None:
            if time.perf_counter() >= hung_at:
                return self.hung(proc, out)
            if (kind == "random" and time.perf_counter() >= deadline) or (kind == "checkpoint" and saving(out)) or (
                    kind == "export" and exporting(out)):
                kill_all(proc)
                return kind
            if kind == "rank" and started_training is None and training(log):
                started_training = time.perf_counter()
            if kind == "rank" and started_training is not None and time.perf_counter() >= started_training + delay["rank"]:
                return self.kill_rank(proc, log)
            time.sleep(0.005)
        return None

    def hung(self, proc: subprocess.Popen, out: Path) -> str:
        locks = [str(p) for p in Path(env()["TORCH_EXTENSIONS_DIR"]).glob("*/lock")]
        self.failures.append(f"{out}: a start still running after {self.args.hang_factor:.0f} x the reference run "
                             f"({self.args.hang_factor * self.run_seconds:.0f} s); JIT build locks: {locks or 'none'}")
        kill_all(proc)
        return "hung"

    def kill_rank(self, proc: subprocess.Popen, log: Path) -> str | None:
        rank = self.rng.choice([0, 1])
        pid = worker_pid(proc.pid, rank)
        if pid is None:  # not started yet or already gone: kill the whole run instead
            kill_all(proc)
            return "random"
        os.kill(pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        try:
            proc.wait(timeout=self.args.stop_bound)
        except subprocess.TimeoutExpired:
            self.failures.append(f"rank {1 - rank} still running {self.args.stop_bound:.0f} s after rank {rank} died")
            kill_all(proc)
            return "rank"
        with log.open() as f:
            text = f.read()
        text = text[text.rfind("--- start"):]
        # the survivor says "lost rank N" once its collective fails; killed before it got that far (still loading),
        # it is stopped by the launcher, whose report names the rank that failed first
        named = f"lost rank {rank}" in text or re.search(rf"Root Cause[^\[]*\[0\]:[^\[]*rank\s*:\s*{rank}\b", text)
        print(f"  rank {rank} killed: the run stopped in {time.perf_counter() - killed_at:.1f} s"
              f"{'' if named else ' WITHOUT naming the lost rank'}", flush=True)
        if not named:
            self.failures.append(f"the lost rank {rank} was not named")
        return "rank"

    def check_checkpoints(self, out: Path) -> None:
        for path in sorted((out / "checkpoints").glob("step-*")):
            problem = verify(path)
            if problem is not None:
                self.failures.append(f"{path} corrupt after a kill: {problem}")

    def episode(self, reference: dict) -> None:
        self.episodes += 1
        out = self.root / f"episode-{self.episodes}"
        log = self.root / f"episode-{self.episodes}.log"
        restarts = 0
        while True:
            with log.open("a") as f:
                f.write(f"\n--- start {restarts}\n")
            proc = self.start(out, log)
            started = time.perf_counter()
            kind = self.kill_once(proc, out, log) if self.kills < self.args.kills else None
            if kind == "hung":
                return
            if kind is None:
                try:
                    code = proc.wait(timeout=self.args.hang_factor * self.run_seconds)
                except subprocess.TimeoutExpired:
                    self.hung(proc, out)
                    return
                if code != 0:
                    self.failures.append(f"episode {self.episodes}: restart {restarts} failed by itself (rc {code}); "
                                         f"see {log}")
                    return
                if restarts == 0:  # an undisturbed run: the time scale of random kills (the first run builds caches)
                    self.run_seconds = time.perf_counter() - started
                dw = max_dw(final_weights(out), reference)
                self.max_dw = max(self.max_dw, dw)
                print(f"episode {self.episodes}: done after {restarts} resumes, max |dw| = {dw:.3g}", flush=True)
                if dw > self.args.tol:
                    self.failures.append(f"episode {self.episodes}: final weights differ by {dw:.3g}")
                return
            self.kills += 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            print(f"kill {self.kills}: {kind}", flush=True)
            self.check_checkpoints(out)
            restarts += 1
            self.resumes += 1

    def summary(self) -> dict:
        return {"algo": self.args.algo, "engine": self.args.engine, "kills": self.kills, "kinds": self.kinds,
                "resumes": self.resumes, "episodes": self.episodes, "failures": len(self.failures),
                "max_abs_dw": self.max_dw, "problems": self.failures}


def main(argv_: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="sft", choices=["sft", "grpo"])
    parser.add_argument("--engine", default="single", choices=list(ENGINES))
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", type=lambda s: s.split(","), help="kill kinds in this order (default: drawn)")
    parser.add_argument("--tol", type=float, default=0.0, help="largest |dw| against the reference counted as equal")
    parser.add_argument("--stop-bound", type=float, default=90.0, help="seconds a lone rank may take to stop")
    parser.add_argument("--hang-factor", type=float, default=10.0,
                        help="a start running longer than this many times the reference run counts as hung")
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv_)
    root = Path(args.out or tempfile.mkdtemp(prefix="posttrain-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    from posttrain.models.tiny import make_tiny_model
    from posttrain.demo.tasks import write_example_data

    model = make_tiny_model(root / "tiny", arch="llama", seed=0)
    data = write_example_data(root / "data", n_train=64, n_eval=8)
    chaos = Chaos(args, data, Path(model), root)
    reference = chaos.reference()
    while chaos.kills < args.kills and len(chaos.failures) == 0:
        chaos.episode(reference)
        result = chaos.summary()  # so far: a long run stopped early still has its figures
        print(f"kills {result['kills']} {result['kinds']} | resumes {result['resumes']} | episodes "
              f"{result['episodes']} | failures {result['failures']} | max |dw| {result['max_abs_dw']:.3g}", flush=True)
    result = chaos.summary()
    for problem in chaos.failures:
        print(f"  FAILURE: {problem}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    raise SystemExit(1 if main()["failures"] else 0)
