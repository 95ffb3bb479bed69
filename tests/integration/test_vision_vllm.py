"""GRPO with images on the in-process vLLM engine (real vLLM on CPU, fp32): vLLM widens each prompt's image
placeholders itself and the engine checks its prompt equals the trainer's every call, so the tokens sampled are the
tokens trained; the sampler's log-probs equal the trainer's (images on both sides) before and after a sync; a frozen
tower goes with the first sync only and stays bit-identical.

vLLM 0.32's vision-language models need a torchvision that imports (transformers' image processors); where there is
none (posttrain's CPU installs: scripts/setup.sh) the recipe is refused instead (tests/unit/test_vision_generation.py)
and this module is skipped. Each run is its own process (one vLLM engine per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from posttrain.generation.vllm_engine import vllm_available
from posttrain.models.vision import vllm_vision_problem
from tests.integration.helpers import final_weights, metrics, run_overrides

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup EXTRAS=dev,vllm)"),
              pytest.mark.skipif(vllm_available() and vllm_vision_problem() is not None,
                                 reason=f"vLLM cannot load a vision-language model here: {vllm_vision_problem()}")]


def test_grpo_samples_with_the_images_on_vllm(tiny_vlm_dir, shapes_dir, tmp_path):
    out = tmp_path / "run"
    args = run_overrides(tiny_vlm_dir, shapes_dir / "grpo_train.jsonl", out, "train.max_steps=2",
                         "train.per_device_train_batch_size=8", "algo.num_generations=4",
                         "generation.max_completion_length=6", "data.max_length=64", "algo.beta=0.04",
                         "rewards=[{name: format, kwargs: {pattern: '.*e.*'}}]", "model.freeze_vision_tower=true",
                         "generation.engine=vllm", "generation.vllm.kv_cache_gb=1")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "posttrain", "grpo", *args], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stdout + run.stderr
    assert said.count("posttrain: weight sync: the vision tower is frozen: sent with the first sync only; the "
                      "projector trains: sent with every sync") == 1
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    # step 2 samples from the synced policy: vLLM's tied head and image caches follow the sync (0.047 when its tied
    # head kept the start-up weights); CPU vLLM's own noise is ~1.5e-3 (text models' bound: test_grpo_vllm.py)
    assert all(r["sampler_logprob_gap"] < 4e-3 for r in rows), rows
    assert any(r["reward/std"] > 0 for r in rows)
    initial, trained = load_file(str(tiny_vlm_dir / "model.safetensors")), final_weights(out)
    tower = [k for k in initial if k.startswith("visual.") and ".merger." not in k]  # as final/ names them
    assert tower and all(torch.equal(initial[k], trained[k]) for k in tower)
    assert sum(not torch.equal(initial[k], trained[k]) for k in initial if k not in tower) > len(initial) // 3
