"""make_optimizer: weight decay groups, the fused AdamW step and its agreement with the unfused one."""

import dataclasses

import torch

from posttrain.config.schema import TrainConfig
from posttrain.train.optim import make_optimizer


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def train(model: torch.nn.Module, t: TrainConfig, steps: int = 12) -> torch.optim.Optimizer:
    optimizer = make_optimizer(model, t)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def test_fused_is_the_default_and_can_be_turned_off():
    t = TrainConfig(weight_decay=0.1)
    assert make_optimizer(small_model(0), t).defaults["fused"] is True
    assert not make_optimizer(small_model(0), dataclasses.replace(t, fused_optimizer=False)).defaults["fused"]


def test_decay_skips_biases_and_norms():
    optimizer = make_optimizer(small_model(0), TrainConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert sorted(p.ndim for p in decay["params"]) == [2, 2]  # the two Linear weights only
    assert len(no_decay["params"]) == 4  # two biases, the norm's weight and bias


def test_fused_step_equals_the_unfused_step_within_rounding():
    t = TrainConfig(weight_decay=0.1, learning_rate=1e-2)
    fused, plain = small_model(0), small_model(0)
    train(fused, t)
    train(plain, dataclasses.replace(t, fused_optimizer=False))
    start = small_model(0)
    for a, b, s in zip(fused.parameters(), plain.parameters(), start.parameters()):
        assert (a - s).abs().max() > 1e-3  # both moved
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_one_step_run_with_warmup_trains_nothing_and_is_told_so():
    """The schedule really gives the only step learning rate 0; the run says so (it used to end at exit 0 silently)."""
    from posttrain.train.optim import make_scheduler, warmup_trains_nothing

    model = torch.nn.Linear(2, 2)
    for t in (TrainConfig(warmup_ratio=0.05), TrainConfig(warmup_steps=3, lr_scheduler_type="constant")):
        scheduler = make_scheduler(make_optimizer(model, t), t, total_steps=1)
        assert scheduler.get_last_lr()[0] == 0.0  # what step 1 trains with
        message = warmup_trains_nothing(t, 1)
        assert "learning rate 0" in message and "this run trains nothing" in message
        assert ("warmup_ratio=0.05" if t.warmup_ratio else "warmup_steps=3") in message
        assert warmup_trains_nothing(t, 2) == ""  # step 2 moves: a warmup, not a run of nothing
    assert warmup_trains_nothing(TrainConfig(), 1) == ""
