"""Which launches may continue a checkpoint: the global batch always; the process count only where the engine's
files can be read into another layout (whole weights, or FSDP2's torch.distributed.checkpoint shards)."""

from __future__ import annotations

import json

import pytest

from posttrain.checkpoint import check_compatible
from posttrain.errors import UserError


def facts(engine: str, world_size: int, per_device: int = 1, accumulation: int = 2) -> dict:
    return {"world_size": world_size, "nodes": 1, "engine": engine,
            "global_batch": world_size * per_device * accumulation, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation}


def saved(tmp_path, run: dict):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"run": run}))
    return tmp_path


@pytest.mark.parametrize("before, after", [
    (("ddp", 2), ("single", 1)),
    (("single", 1), ("ddp", 2)),
    (("fsdp2", 2), ("fsdp2", 1)),
    (("fsdp2", 2), ("fsdp2", 4)),
    (("deepspeed-zero3", 2), ("deepspeed-zero3", 2)),
])
def test_launches_that_continue(tmp_path, before, after):
    (e0, w0), (e1, w1) = before, after
    path = saved(tmp_path, facts(e0, w0, accumulation=4 // w0))
    check_compatible(path, facts(e1, w1, accumulation=4 // w1))


@pytest.mark.parametrize("before, after, says", [
    (("deepspeed-zero2", 2), ("deepspeed-zero2", 1), "deepspeed-zero2 state sharded over 2 processes"),
    (("fsdp2", 2), ("single", 1), "this run is single on 1"),
    (("fsdp2", 2), ("deepspeed-zero3", 2), "this run is deepspeed-zero3 on 2"),
    (("ddp", 2), ("fsdp2", 2), "this run is fsdp2 on 2"),
])
def test_launches_that_stop_and_say_why(tmp_path, before, after, says):
    (e0, w0), (e1, w1) = before, after
    path = saved(tmp_path, facts(e0, w0, accumulation=4 // w0))
    with pytest.raises(UserError, match=says):
        check_compatible(path, facts(e1, w1, accumulation=4 // w1))


def test_another_global_batch_stops_whatever_the_engine(tmp_path):
    path = saved(tmp_path, facts("fsdp2", 2, accumulation=2))
    with pytest.raises(UserError, match="global batch of 4"):
        check_compatible(path, facts("fsdp2", 1, accumulation=2))
