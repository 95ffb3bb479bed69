"""Which launches may continue a checkpoint: the same global batch always, the same engine for sharded state; the
process count may change (DeepSpeed's via its universal format: check_compatible says when to convert)."""

from __future__ import annotations

import json

import pytest

from posttrain.rundir.checkpoint import check_compatible
from posttrain.errors import UserError


def facts(engine: str, world_size: int, per_device: int = 1, accumulation: int = 2) -> dict:
    return {"world_size": world_size, "nodes": 1, "engine": engine,
            "global_batch": world_size * per_device * accumulation, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation}


def saved(tmp_path, run: dict):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"run": run}))
    return tmp_path


@pytest.mark.parametrize("before, after, convert", [
    (("ddp", 2), ("single", 1), False),
    (("single", 1), ("ddp", 2), False),
    (("fsdp2", 2), ("fsdp2", 1), False),
    (("fsdp2", 2), ("fsdp2", 4), False),
    (("deepspeed-zero3", 2), ("deepspeed-zero3", 2), False),
    (("deepspeed-zero2", 2), ("deepspeed-zero2", 1), True),
    (("deepspeed-zero3", 1), ("deepspeed-zero3", 4), True),
])
def test_launches_that_continue(tmp_path, before, after, convert):
    (e0, w0), (e1, w1) = before, after
    path = saved(tmp_path, facts(e0, w0, accumulation=4 // w0))
    assert check_compatible(path, facts(e1, w1, accumulation=4 // w1)) is convert


@pytest.mark.parametrize("before, after, says", [
    (("deepspeed-zero2", 2), ("single", 1), "deepspeed-zero2 state sharded over 2 processes; this run is single on 1"),
    (("fsdp2", 2), ("deepspeed-zero3", 2), "this run is deepspeed-zero3 on 2"),
    (("deepspeed-zero2", 2), ("deepspeed-zero3", 2), "this run is deepspeed-zero3 on 2"),
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
