"""`posttrain plan` without a download: the built-in shapes (plan/known_models.py) give the parameter counts the model
cards publish, instruct variants find their base, and the plan says the dtypes it assumes and prints a launch
command with absolute paths."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.schema import ModelConfig
from posttrain.plan.known_models import known_name
from posttrain.plan.shape import model_shape

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    """Offline, with an empty Hugging Face cache, from a directory that is not the repository."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name, published", [  # the model cards' parameter counts
    ("Qwen/Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen/Qwen3-8B", 8.2e9), ("Qwen/Qwen3-30B-A3B", 30.5e9),
    ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9), ("mistralai/Mixtral-8x7B-v0.1", 46.7e9),
    ("google/gemma-2-9b-it", 9.24e9), ("microsoft/phi-4", 14.7e9), ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9),
    ("Qwen/Qwen2.5-VL-7B-Instruct", 8.29e9), ("Qwen/Qwen3-VL-8B-Instruct", 8.77e9),  # vision towers included
])
def test_built_in_shapes_have_the_published_parameter_counts(name, published, no_cache):
    model_shape.cache_clear()
    assert model_shape(ModelConfig(name_or_path=name)).parameters == pytest.approx(published, rel=0.01)


def test_variants_find_their_base_and_unknown_names_none():
    assert known_name("qwen/qwen2.5-7b-instruct") == "Qwen/Qwen2.5-7B"
    assert known_name("google/gemma-3-1b-it") == "google/gemma-3-1b-pt"
    assert known_name("meta-llama/Llama-3.3-70B-Instruct") == "meta-llama/Llama-3.1-70B"
    assert known_name("Qwen/Qwen3-30B-A3B-Instruct-2507") == "Qwen/Qwen3-30B-A3B"
    assert known_name("someone/Qwen2.5-7B") is None and known_name("Qwen/Qwen2.5-8B") is None


@pytest.mark.parametrize("model, flags, said", [
    ("Qwen/Qwen2.5-7B", ["--bf16"], "weights in float32 (model.dtype), autocast bf16 (train.mixed_precision) "
                                    "[--dtype bfloat16 plans bf16 weights]"),
    ("meta-llama/Llama-3.1-8B-Instruct", ["--dtype", "bfloat16"], "weights in bfloat16 (model.dtype), autocast none"),
    ("google/gemma-2-2b-it", ["--bf16", "--dtype", "bfloat16"], "weights in bfloat16 (model.dtype), autocast bf16"),
])
def test_plan_offline_says_its_dtypes_and_launches_with_absolute_paths(model, flags, said, no_cache, capsys):
    model_shape.cache_clear()
    recipe = ROOT / "recipes" / "sft.yaml"
    assert main(["plan", "--config", str(recipe), f"model.name_or_path={model}", "--gpus", "8", "--gpu-memory", "80GiB", *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"posttrain plan: sft, {model} (built-in shape of ") and said in out[0], out[0]
    launch = shlex.split(next(line for line in out if line.startswith("  accelerate launch") or " torchrun " in line))
    paths = [word for word in launch if word.endswith(".yaml")]
    assert paths and all(Path(p).is_absolute() and Path(p).is_file() for p in paths), launch


def test_plan_takes_what_a_training_command_takes_in_any_order(no_cache, capsys):
    """`key=value` after an option, and a training command's TRL flags: plan refused both (unrecognized arguments)."""
    model_shape.cache_clear()
    recipe = ROOT / "recipes" / "sft.yaml"
    assert main(["plan", "--config", str(recipe), "model.name_or_path=Qwen/Qwen2.5-7B", "--gpus", "8",
                 "train.max_steps=3", "--per_device_train_batch_size", "3", "--gpu-memory", "80GiB", "--json"]) == 0
    out = capsys.readouterr().out
    assert "train.per_device_train_batch_size=3" in out and "train.max_steps=3" in out
    assert '"per_device_train_batch_size": 3' in out


def test_plan_counts_a_vlms_tower_and_image_tokens(no_cache, capsys):
    """A built-in VLM: its vision tower's parameters (out of the trainable count when frozen) and its image tokens (the largest image its processor makes, 16384, at most the row; or --image-tokens),
    whose patches the tower's activations hold only when it trains."""
    def plan(*args):
        model_shape.cache_clear()
        assert main(["plan", "--algorithm", "sft", "--gpu-memory", "80GiB", "--json", "data.train=x.jsonl",
                     "model.name_or_path=Qwen/Qwen3-VL-8B-Instruct", "data.max_length=2048", *args]) == 0
        out = json.loads(capsys.readouterr().out)
        return out, next(row["breakdown"]["activations"] for row in out["engines"] if row["engine"] == "ddp")

    trained, worst = plan()
    frozen, frozen_worst = plan("model.freeze_vision_tower=true")
    _, few = plan("--image-tokens", "256")
    _, none = plan("--image-tokens", "0")
    assert trained["parameters"] == frozen["parameters"]
    # the tower less its mergers (model.freeze_projector's), by hand: 27 blocks of width w = 1152, MLP i = 4304 (qkv
    # 3w^2 + 3w, proj w^2 + w, fc1 and fc2 2wi + i + w, two norms 4w), the patch embedding (3 x 2 x 16 x 16 x w + w)
    # and 2304 position embeddings of w
    w, i = 1152, 4304
    block = 3 * w * w + 3 * w + w * w + w + 2 * w * i + i + w + 4 * w
    assert trained["trainable"] - frozen["trainable"] == 27 * block + 3 * 2 * 16 * 16 * w + w + 2304 * w
    assert worst > few > none and worst > frozen_worst > none
    # the tower's kept activations grow with the image tokens: 2048 tokens a row against 256
    assert worst - none == pytest.approx(8 * (few - none), rel=1e-3)
    model_shape.cache_clear()
    assert main(["plan", "--algorithm", "sft", "--gpu-memory", "80GiB", "data.train=x.jsonl",
                 "model.name_or_path=Qwen/Qwen2.5-7B", "--image-tokens", "64"]) == 2
