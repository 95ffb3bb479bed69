"""`posttrain plan` with a hub id that is not cached: the advice says why it could not be fetched, truly, and an
unreachable hub is not retried."""

from __future__ import annotations

import pytest

from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError
from posttrain.plan.shape import read_config


def test_offline_by_choice_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set: unset it") as e:
        read_config(ModelConfig(name_or_path="nobody-posttrain/not-a-model"))
    assert "neither a local directory nor in the Hugging Face cache" in str(e.value)


def test_unreachable_hub_is_not_blamed_on_hf_hub_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(UserError, match="The hub could not be reached") as e:
        read_config(ModelConfig(name_or_path="nobody-posttrain/not-a-model"))
    assert "HF_HUB_OFFLINE" not in str(e.value)
