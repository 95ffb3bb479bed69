"""Every shipped recipe runs as its header says: the `posttrain ...` commands in each recipes/*.yaml header comment,
run in order from a fresh copy of the repository's recipes/ and examples/ per recipe (so a header is complete on its
own, and a header and its recipe cannot drift apart).

The commands run as typed, with a few overrides appended to keep them cheap (one or two steps, no eval, no report)
and `make-tiny-model --out tiny/` answered by the session's tiny model (the same default shape a user gets), which
also stands in for SmolLM2-135M-Instruct in a recipe that names it (REAL_MODEL). vLLM and Ray commands
run in a subprocess (one vLLM engine, one Ray driver per process) where those extras are installed, as in CI;
`posttrain serve` lines are answered by the session's `vllm_server`. Multi-process launch lines (`accelerate launch`,
`torchrun`), GPU lines and lines for a cluster that is not there (`placement.address=<head>:6379`) are left to
tests/distributed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from posttrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
CHEAP = ["train.max_steps=1", "data.eval=null", "train.logging_steps=1", "train.save_steps=0", "train.report=false",
         "train.tensorboard=false"]
ONLINE_CHEAP = ["generation.max_completion_length=4"]  # grpo and ppo: the samples are what a step costs
REAL_MODEL = "~/.cache/posttrain/smollm2-135m-instruct"  # recipes for SmolLM2-135M-Instruct (bench/real_model.py)
LEFT_TO_DISTRIBUTED = ("accelerate launch", "torchrun", "<head>", "$NODE", "CUDA_VISIBLE_DEVICES")  # and GPU lines


def header_commands(recipe: Path) -> list[str]:
    """The shell lines of a recipe's header: comment lines indented as code (`#   posttrain ...`), up to the YAML."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if text.startswith("   ") and not text.startswith("    "):  # `#   cmd`; deeper indents continue the line
            lines.append(text.strip())
        elif text.startswith("    ") and lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + text.strip()
    return lines


def needs(argv: list[str], recipe_text: str) -> str | None:
    """'vllm' or 'ray' where the command needs that extra (and so a process of its own), else None."""
    if "--ray" in argv or "launcher: ray" in recipe_text:
        return "ray"
    if "engine: vllm" in recipe_text or any(a.startswith("generation.engine=vllm") for a in argv):
        return "vllm"
    return None


class Workdir:
    """A copy of recipes/ and examples/ with the tiny model at tiny/; runs header commands, each once."""

    def __init__(self, root: Path, tiny: Path):
        self.root = root
        shutil.copytree(ROOT / "recipes", root / "recipes")
        shutil.copytree(ROOT / "examples", root / "examples")
        (root / "tiny").symlink_to(tiny, target_is_directory=True)
        self.done: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def run(self, line: str, server=None) -> int | None:
        """Run one header line; None where it is not run here (see the module docstring)."""
        if any(mark in line for mark in LEFT_TO_DISTRIBUTED) or line.startswith("export "):
            return None
        argv = shlex.split(line, comments=True)
        if argv[:2] == ["posttrain", "make-tiny-model"] and argv[2:] in (["--out", "tiny/"], ["--out", "tiny"]):
            return 0  # tiny/ is the session's model of the same default shape (another one is made as typed)
        if argv[:2] == ["posttrain", "serve"]:
            if server is None:
                pytest.skip("vLLM is not installed (make setup EXTRAS=dev,vllm)")
            return 0
        assert argv[0] == "posttrain", f"unexpected header command: {line}"
        key = shlex.join(argv)  # the same command with another comment is the same command
        if key in self.done:
            return self.done[key]
        if argv[:2] == ["posttrain", "make-tiny-model"]:  # another model than tiny/ (a teacher): made as typed
            cwd = os.getcwd()
            os.chdir(self.root)
            try:
                self.done[key] = main(argv[1:])
            finally:
                os.chdir(cwd)
            return self.done[key]
        if server is not None:  # the header's URL is the session server's, and so is the recipe's (a judge's)
            argv = [a.replace("http://127.0.0.1:8000", server.url) for a in argv]
            config = self.root / argv[argv.index("--config") + 1]
            config.write_text(config.read_text().replace("http://127.0.0.1:8000", server.url))
        recipe_text = (self.root / argv[argv.index("--config") + 1]).read_text()
        # grpo and ppo sample fewer tokens, except beside DAPO's overlong reward, whose cap the recipe sets to the
        # completion length (a shorter completion would make it a setting that cannot act, refused at start-up)
        cheap_online = argv[1] in ("grpo", "ppo") and "name: overlong" not in recipe_text
        argv = argv[1:] + CHEAP + (ONLINE_CHEAP if cheap_online else [])
        if "eval_pass_k" in recipe_text:  # CHEAP drops data.eval, so pass@k would have nothing to evaluate (refused)
            argv.append("train.eval_pass_k=[]")
        if REAL_MODEL in recipe_text:  # the real model is tests/real's (built from a GGUF): here the tiny one
            argv.append("model.name_or_path=tiny/")
        extra = needs(argv, recipe_text)
        started = time.perf_counter()
        if extra is None:
            cwd = os.getcwd()
            os.chdir(self.root)
            try:
                code = main(argv)
            finally:
                os.chdir(cwd)
        else:
            pytest.importorskip(extra, reason=f"the {extra} extra is not installed (CI: EXTRAS=dev,vllm,ray)")
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   "VLLM_CPU_KVCACHE_SPACE": "1"}
            code, out, heard = run_listening([sys.executable, "-m", "posttrain", *argv], self.root, env)
            assert code == 0, f"{line}\n{out[-8000:]}"
            if extra == "ray" and not any(a.startswith("placement.address=") for a in argv):
                check_local_cluster(heard, out)
        self.seconds[key] = time.perf_counter() - started
        self.done[key] = code
        return code


def run_listening(argv: list[str], cwd: Path, env: dict) -> tuple[int, str, dict]:
    """Run a command (600 s at most); meanwhile note every TCP/UDP socket its processes listen on, and who."""
    import psutil

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        root, heard, deadline = psutil.Process(proc.pid), {}, time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        for c in p.net_connections(kind="inet"):
                            if c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and not c.raddr):
                                heard.setdefault((c.laddr.ip, c.laddr.port), " ".join(p.cmdline())[:120])
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.seek(0)
        return proc.returncode, log.read(), heard


def loopback(address) -> bool:
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # gRPC's [::ffff:127.0.0.1] too


def check_local_cluster(heard: dict, out: str) -> None:
    """docs/ray.md: a cluster started for the run listens on 127.0.0.1 only (its GCS, raylet, workers, agents, the
    driver, and the ranks' rendezvous), and keeps its session where it says (test_ray_inputs.py: which folder)."""
    assert heard, "no listener seen: the check saw nothing of the cluster"
    wide = {f"{ip}:{port}": who for (ip, port), who in heard.items()
            if not loopback(ipaddress.ip_address(ip))}
    assert not wide, f"listening beyond 127.0.0.1: {wide}"
    logs = re.search(r"a local cluster for this run, on 127.0.0.1 only; its logs under (\S+)", out)
    assert logs and Path(logs[1], "session_latest").resolve().is_dir(), out[-3000:]  # output_dir/ray where it fits


SECONDS: dict[str, float] = {}  # per recipe, printed at the end of the module (the figure CI's budget watches)


@pytest.fixture(scope="module", autouse=True)
def report_seconds():
    yield
    print(f"\nrecipe header commands: {sum(SECONDS.values()):.0f} s in all; "
          + ", ".join(f"{name} {s:.0f} s" for name, s in SECONDS.items()))


@pytest.fixture
def workdir(tmp_path, tiny_vllm_model_dir, request):
    work = Workdir(tmp_path, tiny_vllm_model_dir)
    yield work
    SECONDS[request.node.callspec.params["name"]] = sum(work.seconds.values())


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_header_commands_run(name, workdir, request, capfd):
    lines = header_commands(ROOT / "recipes" / name)
    assert any(line.startswith("posttrain ") for line in lines) or name == "grpo_multinode_servers.yaml", \
        f"recipes/{name} has no `posttrain ...` command in its header"
    server = request.getfixturevalue("vllm_server") if any("posttrain serve" in ln for ln in lines) else None
    ran = []
    for line in lines:
        code = workdir.run(line, server)
        if code is not None:
            assert code == 0, f"recipes/{name}: `{line}` exited {code}"
            ran.append(line)
    trained = [ln for ln in ran if not ln.startswith(("posttrain make-tiny-model", "posttrain serve"))]
    if name == "grpo_multinode_servers.yaml":
        assert not trained  # its header is multi-node launch lines only (tests/distributed covers those)
        return
    assert trained, f"recipes/{name}: no header command trained anything"
    out_dir = next(ln.split(": ", 1)[1].strip() for ln in (ROOT / "recipes" / name).read_text().splitlines()
                   if ln.startswith("output_dir:"))
    assert (workdir.root / out_dir / "final" / "config.json").is_file(), f"recipes/{name} wrote no {out_dir}/final"
    console = capfd.readouterr()
    if name in ("grpo.yaml", "ppo.yaml", "ppo_rm.yaml"):  # online runs in this process: the reward on the progress line
        assert re.search(r"step 1/1 loss=\S+ grad_norm=\S+ learning_rate=\S+ reward/mean=", console.out), \
            console.out[-2000:]
    for noise in ("Setting accelerator to CPU", "LOAD REPORT", "Removed shared tensor"):  # a healthy run's console
        assert noise not in console.out + console.err, noise
