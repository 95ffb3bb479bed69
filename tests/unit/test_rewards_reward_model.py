"""RewardModelScorer on a tiny random sequence-classification model saved like `posttrain rm` saves one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from posttrain.config.schema import RewardConfig
from posttrain.errors import UserError
from posttrain.rewards.load import load_reward
from posttrain.rewards.reward_model import RewardModelScorer, load_scorer

PROMPTS = ["What is 2 + 2?", "Say something nice about the sea."]
COMPLETIONS = [" 4", " The sea is calm and blue today, a fine sight."]
CHAT = [[{"role": "user", "content": p}] for p in PROMPTS]


def save_classifier(out, tokenizer, num_labels=1):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores far enough apart to tell texts apart
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tokenizer):
    return save_classifier(tmp_path_factory.mktemp("rm"), tokenizer)


def reference_score(rm_dir, ids: list[int]) -> float:
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def plain_ids(tokenizer, prompt: str, completion: str) -> list[int]:
    """As posttrain.data tokenises a standard pair for `posttrain rm`: prompt with special tokens, completion + EOS."""
    return tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]


def test_scores_plain_prompts(rm_dir, tokenizer):
    scorer = RewardModelScorer(str(rm_dir), device="cpu", batch_size=2)
    scores = scorer(PROMPTS, COMPLETIONS)
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    for prompt, completion, score in zip(PROMPTS, COMPLETIONS, scores):
        assert score == pytest.approx(reference_score(rm_dir, plain_ids(tokenizer, prompt, completion)), abs=1e-5)
    assert scores[0] != pytest.approx(scores[1])


def test_scores_chat_prompts_with_the_template(rm_dir, tokenizer):
    scores = RewardModelScorer(str(rm_dir), device="cpu")(CHAT, COMPLETIONS)
    for messages, completion, score in zip(CHAT, COMPLETIONS, scores):
        text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)
        assert text.endswith(completion + "<|im_end|>\n")
        # as `posttrain rm` trained: prompt + generation prompt, then the turn through <|im_end|> (not the "\n")
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"] + tokenizer(
            completion + "<|im_end|>", add_special_tokens=False
        )["input_ids"]
        assert score == pytest.approx(reference_score(rm_dir, ids), abs=1e-5)


def test_batching_and_padding_do_not_change_scores(rm_dir):
    batched = RewardModelScorer(str(rm_dir), device="cpu", batch_size=8)(PROMPTS * 2, COMPLETIONS * 2)
    single = RewardModelScorer(str(rm_dir), device="cpu", batch_size=1)(PROMPTS * 2, COMPLETIONS * 2)
    assert batched == pytest.approx(single, abs=1e-5)


def test_max_length_keeps_the_end(rm_dir, tokenizer):
    scorer = RewardModelScorer(str(rm_dir), device="cpu", max_length=5)
    ids = scorer.encode(PROMPTS[1], COMPLETIONS[1])
    assert ids == plain_ids(tokenizer, PROMPTS[1], COMPLETIONS[1])[-5:]


def test_builtin_reward_model_loads_once(rm_dir):
    reward = load_reward(RewardConfig(name="reward_model", kwargs={"path": str(rm_dir), "device": "cpu"}))
    assert reward.name == "reward_model"
    scores = reward.fn(PROMPTS, COMPLETIONS, answer=["x", "y"])
    assert scores == pytest.approx(RewardModelScorer(str(rm_dir), device="cpu")(PROMPTS, COMPLETIONS), abs=1e-6)
    assert load_scorer(str(rm_dir), device="cpu") is load_scorer(path=str(rm_dir), device="cpu", batch_size=8)


def test_rejects_what_is_not_a_reward_model(tmp_path, tiny_model_dir, tokenizer):
    with pytest.raises(UserError, match="reward_model kwargs.path: local path .* does not exist"):
        RewardModelScorer(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="holds a LlamaForCausalLM, not a reward model"):
        RewardModelScorer(str(tiny_model_dir))
    with pytest.raises(UserError, match="has 2 labels"):
        RewardModelScorer(str(save_classifier(tmp_path / "two", tokenizer, num_labels=2)))


def test_reward_funcs_model_path_scores_message_list_completions(rm_dir, tokenizer):
    """--reward_funcs <dir> (TRL's way to name a reward model) scores TRL's conversational completions exactly as
    the assistant-turn strings; a multi-turn completion goes through the chat template whole."""
    from posttrain.config.trl_rewards import rewards_from_trl
    from posttrain.rewards import as_completions, load_rewards

    entries, problems = rewards_from_trl({"reward_funcs": [str(rm_dir)]})
    assert problems == [] and entries == [{"name": "reward_model", "kwargs": {"path": str(rm_dir)}}]
    rewards = load_rewards([RewardConfig(name=e["name"], kwargs={**e["kwargs"], "device": "cpu"}) for e in entries])
    scores = rewards.score(CHAT, as_completions(CHAT, COMPLETIONS)).total_B.tolist()
    assert scores == pytest.approx(RewardModelScorer(str(rm_dir), device="cpu")(CHAT, COMPLETIONS), abs=1e-6)
    turns = [{"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "ok"},
             {"role": "assistant", "content": COMPLETIONS[0]}]
    scorer = RewardModelScorer(str(rm_dir), device="cpu")
    text = tokenizer.apply_chat_template(CHAT[0] + turns, tokenize=False)
    assert tokenizer.decode(scorer.encode(CHAT[0], turns)) == text.rstrip()
