"""The longest sequence a run asks for must fit the model's positions, read from config.json (issue #25)."""

from __future__ import annotations

import json

import pytest

from posttrain.config.load import load_recipe
from posttrain.config.schema import SFTAlgoConfig
from posttrain.errors import UserError
from posttrain.models.limits import check_position_limit, position_limit


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 1024}))
    return tmp_path


def recipe(model_dir, *extra):
    return load_recipe(None, [f"model.name_or_path={model_dir}", "data.train=x.jsonl", *extra], SFTAlgoConfig)


def test_max_length_beyond_the_positions_is_refused_naming_the_key(model_dir):
    check_position_limit(recipe(model_dir, "data.max_length=1024"), "sft")
    with pytest.raises(UserError, match=r"data.max_length = 1,000,000,000,000, but the model holds 1,024 positions "
                                        r"\(max_position_embeddings in .*config.json\)"):
        check_position_limit(recipe(model_dir, "data.max_length=1000000000000"), "preference")


def test_prompt_plus_completion_beyond_the_positions_is_refused(model_dir):
    fits = recipe(model_dir, "data.max_length=4096", "data.max_prompt_length=512",
                  "generation.max_completion_length=512")
    check_position_limit(fits, "prompt")  # data.max_length is not what generation uses
    with pytest.raises(UserError, match=r"data.max_prompt_length \+ generation.max_completion_length = 1,025"):
        check_position_limit(recipe(model_dir, "data.max_prompt_length=512", "generation.max_completion_length=513"),
                             "prompt")


def test_the_limit_is_read_from_the_config_or_its_text_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"n_positions": 2048}))
    assert position_limit(config) == (2048, "n_positions")
    config.write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert position_limit(config) == (4096, "max_position_embeddings")
    config.write_text(json.dumps({"hidden_size": 8}))
    assert position_limit(config) is None
