"""generation.lora_sync=adapter, the parts that need no server: adapter names per sync, vLLM's LoRA rank, what a
sync sends (peft's own adapter file, loadable by peft), the probe comparison against hand numbers and against the
tiny LoRA policy itself, and the start-up refusals (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.algorithms import ALGORITHMS
from posttrain.config import load_recipe
from posttrain.errors import RunStopped, UserError
from posttrain.generation.adapter_sync import (KEEP, AdapterNames, DeliveryProbe, adapter_config, check_delivery,
                                            max_lora_rank, parse_name, probe_gap, write_adapter)


def test_every_sync_gets_a_new_name_and_runs_never_share_one():
    names = AdapterNames("ab12cd34")
    assert names.current == ""
    assert [names.next(), names.next(), names.next()] == [f"posttrain-ab12cd34-{i}" for i in (1, 2, 3)]
    assert names.current == "posttrain-ab12cd34-3" and parse_name(names.current) == ("ab12cd34", 3)
    assert AdapterNames().next() != AdapterNames().next()  # a random run key each run
    for foreign in ("policy", "posttrain-", "posttrain-x-y", "posttrain-../../etc-1", "posttrain-a/b-2"):
        with pytest.raises(ValueError):
            parse_name(foreign)


@pytest.mark.parametrize("r, rank", [(1, 1), (4, 8), (8, 8), (9, 16), (300, 320), (512, 512)])
def test_max_lora_rank_is_the_smallest_vllm_choice_that_holds_r(r, rank):
    assert max_lora_rank(r) == rank


def test_max_lora_rank_above_vllms_largest_is_refused():
    with pytest.raises(ValueError, match="512"):
        max_lora_rank(513)


def test_probe_gap_against_hand_numbers():
    server = torch.tensor([-1.0, -2.0, -0.5])
    assert probe_gap(server, torch.tensor([-1.01, -2.5, -0.5])) == pytest.approx(0.5)
    assert probe_gap(server, server.clone()) == 0.0
    assert probe_gap(server, torch.tensor([-1.0, -2.0])) == float("inf")  # a token missing
    assert probe_gap(server, torch.tensor([-1.0, float("nan"), -0.5])) == float("inf")
    assert probe_gap(torch.tensor([]), torch.tensor([])) == float("inf")  # nothing compared is no proof


@pytest.fixture(scope="module")
def lora_policy(tiny_model_dir):
    """The tiny model with r=4 adapters whose B is not zero (as after training)."""
    from posttrain.config import LoraConfig, ModelConfig
    from posttrain.models.load import apply_lora, load_causal_lm

    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(ModelConfig(name_or_path=str(tiny_model_dir))),
                       LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5)
    return model.eval()


def test_an_adapter_sync_sends_what_peft_saves_and_peft_loads_it_back(lora_policy, tiny_model_dir, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    from posttrain.config import ModelConfig
    from posttrain.distributed.weight_sync import adapter_units
    from posttrain.models.load import load_causal_lm

    sent = {u.name: u.compute([p.data for p in u.params]) for u in adapter_units(lora_policy)}
    saved = get_peft_model_state_dict(lora_policy)
    assert sent.keys() == saved.keys() and all(torch.equal(sent[k], saved[k]) for k in saved)
    assert all(".lora_A." in k or ".lora_B." in k for k in sent)
    full = sum(p.numel() for p in lora_policy.get_base_model().parameters())
    assert sum(t.numel() for t in sent.values()) < full / 10  # the point: a small fraction of the model travels

    config = adapter_config(lora_policy)
    assert json.loads(json.dumps(config)) == config and config["r"] == 4 and config["lora_alpha"] == 8
    path = write_adapter(tmp_path, "posttrain-run1-1", sent, config)
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(load_causal_lm(ModelConfig(name_or_path=str(tiny_model_dir))), path).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, lora_policy(input_ids=ids).logits)


def test_a_server_keeps_the_last_adapters_of_a_run_and_other_runs_untouched(tmp_path):
    tensor = {"base_model.model.x.lora_A.weight": torch.zeros(2, 2)}
    write_adapter(tmp_path, "posttrain-other-1", tensor, {})
    for count in range(1, 5):
        write_adapter(tmp_path, f"posttrain-run-{count}", tensor, {})
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["posttrain-other-1"] + [f"posttrain-run-{c}" for c in range(5 - KEEP, 5)]


class Policy:
    """The policy role's two methods check_delivery calls, over a real peft model."""

    def __init__(self, model):
        self.model = model

    def train(self, mode=True):
        self.model.train(mode)

    def logprobs(self, batch, temperature=1.0):
        from posttrain.models.forward import policy_logprobs

        return policy_logprobs(self.model, batch, temperature)


def probe_of(model, prompt, completion, server="http://gpu7:8000"):
    """What a server holding exactly `model` answers: the teacher-forced log-probs of its tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs_T = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logprobs_T[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]]
    return DeliveryProbe(server, "posttrain-run-3", prompt, completion, picked.tolist())


def test_check_delivery_passes_the_policys_own_probe_and_stops_naming_the_server_on_another(lora_policy):
    policy = Policy(lora_policy)
    prompt, completion = [5, 17, 42, 99, 3], [250, 7, 11, 12]
    check_delivery([probe_of(lora_policy, prompt, completion)], policy, "cpu", 1e-4, 3)
    with lora_policy.disable_adapter():  # the adapter never delivered: the server serves the base model
        undelivered = probe_of(lora_policy, prompt, completion)
    with pytest.raises(RunStopped) as stopped:
        check_delivery([probe_of(lora_policy, prompt, completion, "http://ok:1"), undelivered], policy, "cpu", 1e-4, 3)
    message = str(stopped.value)
    assert "http://gpu7:8000" in message and "posttrain-run-3" in message and "version 3" in message
    assert stopped.value.exit_code == 1
    lora_policy.eval()


GRPO = ["data.train=a.jsonl", "rewards=[{name: exact_match}]"]


@pytest.mark.parametrize("overrides, message", [
    (["generation.lora_sync=adapter", "generation.engine=vllm", "generation.placement=servers",
      "generation.servers=[http://a:1]"], "model.lora.enabled is false"),
    (["generation.lora_sync=adapter", "model.lora.enabled=true"], "engine=hf placement=colocated"),
    (["generation.lora_sync=adapter", "model.lora.enabled=true", "generation.engine=vllm"],
     "engine=vllm placement=colocated"),
    (["generation.lora_sync=adapter", "model.lora.enabled=true", "model.lora.r=1024", "generation.engine=vllm",
      "generation.placement=node"], "above vLLM's largest"),
    (["generation.lora_sync=adapters"], "generation.lora_sync.*merged, adapter"),
])
def test_lora_sync_adapter_where_it_cannot_work_exits_2(overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, GRPO + overrides, ALGORITHMS["grpo"][0])


def test_lora_sync_adapter_on_servers_loads_and_asks_the_servers_for_lora():
    from posttrain.generation.server_process import serve_args

    recipe = load_recipe(None, GRPO + ["generation.lora_sync=adapter", "model.lora.enabled=true", "model.lora.r=4",
                                       "model.name_or_path=tiny/", "generation.engine=vllm",
                                       "generation.placement=node"], ALGORITHMS["grpo"][0])
    args = serve_args(recipe, 1)
    assert args[args.index("--enable-lora"):][:3] == ["--enable-lora", "--max-lora-rank", "8"]
