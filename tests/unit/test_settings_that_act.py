"""Issue 48 class 9: a setting that cannot act is refused at start-up, naming it (it used to be accepted and do
nothing)."""

from __future__ import annotations

import pytest

from posttrain.algorithms import ALGORITHMS
from posttrain.config.load import load_recipe
from posttrain.errors import UserError
from posttrain.online.evaluation import check_eval_settings


def recipe(command, *overrides):
    return load_recipe(None, ["data.train=x.jsonl", *overrides], ALGORITHMS[command][0])


@pytest.mark.parametrize("command, overrides, message", [
    ("sft", ["data.eval=e.jsonl"], "only the online algorithms do .*: drop train.eval_pass_k"),
    ("dpo", ["data.eval=e.jsonl"], "only the online algorithms do"),
    ("grpo", ["rewards=[{name: exact_match}]"], "train.eval_pass_k evaluates on data.eval, which is not set"),
])
def test_eval_pass_k_where_nothing_samples_the_eval_prompts_is_refused(command, overrides, message):
    r = recipe(command, "train.eval_pass_k=[1,2]", "generation.temperature=1.0", *overrides)
    with pytest.raises(UserError, match=message):
        check_eval_settings(r, ALGORITHMS[command][1](r))
    fine = recipe("grpo", "train.eval_pass_k=[1,2]", "data.eval=e.jsonl", "rewards=[{name: exact_match}]")
    check_eval_settings(fine, ALGORITHMS["grpo"][1](fine))


@pytest.mark.parametrize("max_length, buffer, refused", [(4096, 128, True), (384, 128, True), (383, 128, False),
                                                         (256, 64, False), (512, 300, False)])
def test_an_overlong_penalty_that_can_never_apply_is_refused(max_length, buffer, refused):
    overrides = ["generation.max_completion_length=256",
                 f"rewards=[{{name: exact_match}}, {{name: overlong, kwargs: {{max_length: {max_length}, "
                 f"buffer: {buffer}}}}}]"]
    if not refused:
        recipe("grpo", *overrides)
        return
    with pytest.raises(UserError, match=rf"rewards\[1\] overlong: its penalty starts past kwargs.max_length - "
                                        rf"kwargs.buffer = {max_length - buffer} tokens, but "
                                        r"generation.max_completion_length=256 ends every completion before that"):
        recipe("grpo", *overrides)
