"""Partial rollouts (online/partial.py) driven by a real engine, the HF one on the tiny model, whose weights the test
changes at each "sync" as a trainer would: a completion straddling a sync continues from its tokens so far, each
chunk's log-probs are those of the weights that sampled it, the fixed pace gives the same tokens whether or not a
checkpoint came between, and the version cap drops what would span too many. The in-process vLLM engine and a server
run the same schedule in tests/integration/test_grpo_vllm.py and test_server.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.algorithms.grpo import GRPOAlgoConfig
from posttrain.config.load import load_recipe
from posttrain.config.schema import GenerationConfig
from posttrain.errors import UserError
from posttrain.generation.hf import HFEngine
from posttrain.online.engine_link import EngineLink, Sample
from posttrain.online.in_flight import InFlight
from posttrain.online.partial import PartialInFlight, partial_metrics

GROUP = 2


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tmp_path_factory):
    from posttrain.config.schema import Recipe
    from posttrain.distributed.backend import Backend

    backend = Backend(Recipe(output_dir=str(tmp_path_factory.mktemp("run"))))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    noise = {k: torch.randn(v.shape, generator=g) * 0.2 for k, v in start.items()}

    def weights(version: int) -> dict:
        """The policy of `version` (optimiser steps): the start moved along a fixed direction."""
        return {k: start[k] + version * noise[k] for k in start}

    return model, tokenizer, weights, backend


def generation(**overrides) -> GenerationConfig:
    settings = dict(engine="vllm", max_completion_length=8, max_staleness=2, partial_rollouts=True,
                    partial_chunk_tokens=4, partial_chunks_per_batch=1)
    return GenerationConfig(**{**settings, **overrides})


def prompts_of(tokenizer):
    texts = ["What is 2 + 3?", "Name a colour.", "Count to three:", "The sky is"]

    def prompts(index: int):
        """Batch `index`: two prompts (positions 2i, 2i + 1)."""
        positions = [2 * index, 2 * index + 1]
        return positions, positions, [{"prompt_ids": tokenizer(texts[p % 4])["input_ids"]} for p in positions]

    return prompts


def sync(link: EngineLink, model, weights, step: int) -> None:
    """What the trainer's sync does to an engine with weights of its own: the policy of `step`, stamped."""
    model.load_state_dict(weights(step))
    link.synced_at = step


def run(policy, gen: GenerationConfig, steps: range, queue=None, link=None) -> tuple[list[Sample], PartialInFlight]:
    """The rollout source's schedule for draws `steps` (one generation batch per step): take the batch (waiting for
    the rounds granted), sync, complete it, refill; batch 0 is sampled whole on the spot."""
    model, tokenizer, weights, backend = policy
    queue = queue or PartialInFlight(gen, 1)
    link = link or EngineLink.over(HFEngine(model, tokenizer), backend, gen, seed=3)
    prompts, samples = prompts_of(tokenizer), []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for step in steps:
            taken, refused = queue.take(step, step)
            assert refused is None
            sync(link, model, weights, step)
            if taken is None:
                positions, rows, asked = prompts(step)
                samples.append(link.sample(asked, positions, rows, GROUP))
            else:
                samples.append(queue.complete(taken, link, step))
            queue.refill(step, step, prompts, link, GROUP, pool)
        queue.settle()
    return samples, queue


def teacher_forced(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_a_completion_straddling_a_sync_continues_under_the_new_weights(policy):
    """Pace 1 round of 4 tokens per batch: batch 1's first chunk is sampled ahead by the policy of step 0, its second
    after the sync to step 1, from prompt + first chunk; a row that ended on its stop id in the first chunk is not
    continued. Each chunk's log-probs are the trainer's under the weights that sampled it (the importance weights then
    use each token's own behaviour log-prob)."""
    model, tokenizer, weights, _ = policy
    samples, queue = run(policy, generation(), range(3))
    first = samples[1]
    lengths = [len(c) for c in first.completion_ids]
    assert lengths == [8, 8, 8, 2] and first.completion_ids[3][-1] == tokenizer.eos_token_id  # seeds: row 3 ended
    assert first.token_versions == [[0] * 4 + [1] * 4] * 3 + [[0, 0]] and first.sampled_by == [0] * 4
    assert first.truncated == [True, True, True, False]
    for version, chunk in ((0, slice(0, 4)), (1, slice(4, 8))):
        model.load_state_dict(weights(version))
        for prompt, ids, logprobs in zip(first.prompt_ids, first.completion_ids, first.logprobs):
            if len(ids) > chunk.start:
                expected = teacher_forced(model, prompt, ids[: chunk.stop])[chunk]
                torch.testing.assert_close(torch.tensor(logprobs[chunk]), expected, atol=1e-5, rtol=0)
    assert samples[0].token_versions == [[0] * 8] * 4  # sampled whole on the spot
    assert queue.metrics() == {"partial/chunks_on_the_spot": 2.0}  # the second chunks of batches 1 and 2
    figures = partial_metrics(first.version_figures() + samples[0].version_figures())
    assert figures == {"partial/stale_completion_fraction": 3 / 8, "partial/stale_token_fraction": 12 / 58,
                       "partial/versions_per_completion_mean": 11 / 8, "partial/versions_per_completion_max": 2.0,
                       "partial/dropped": 0.0}


def test_a_checkpoint_with_partial_completions_in_flight_resumes_them_exactly(policy, tmp_path):
    """Pace 5 rounds of 2 tokens (a batch takes 4): after step 0 the thread samples batch 1 whole and batch 2's first
    round; after step 1 batch 2's last three and batch 3's first two, so a checkpoint there holds batch 3 half
    sampled. A queue loaded from it gives steps 2 and 3 the very tokens, log-probs and versions of the uninterrupted
    schedule."""
    gen = generation(partial_chunk_tokens=2, partial_chunks_per_batch=5)
    whole, _ = run(policy, gen, range(4))
    assert whole[2].token_versions == [[0, 0] + [1] * 6] * 4 and whole[3].token_versions == [[1] * 4 + [2] * 4] * 4
    before, queue = run(policy, gen, range(2))
    queue.save(tmp_path, rank=0)
    assert [(b.index, b.rounds, b.finished) for b in queue.batches] == [(2, 4, True), (3, 2, False)]
    resumed = PartialInFlight(gen, 1)
    assert resumed.load(tmp_path, lambda index: [2 * index, 2 * index + 1]) == []
    after, _ = run(policy, gen, range(2, 4), queue=resumed)
    assert before + after == whole
    # a run without partial rollouts cannot continue them: the batch is sampled again (the source warns)
    lines = InFlight(2, 1).load(tmp_path, lambda index: [2 * index, 2 * index + 1])
    assert lines == ["generation batch 3: it holds partial completions (generation.partial_rollouts), which this run "
                     "does not continue"]
    other = PartialInFlight(generation(partial_chunk_tokens=3, partial_chunks_per_batch=3), 1)
    lines = other.load(tmp_path, lambda index: [2 * index, 2 * index + 1])
    assert lines == ["generation batch 3: its unfinished completions do not all hold 2 chunks of "
                     "generation.partial_chunk_tokens=3 tokens (saved by another world size, or with another chunk "
                     "size)"]


def test_a_completion_that_would_span_more_versions_than_the_cap_is_dropped(policy):
    """partial_max_versions=1: batch 1's unfinished rows, sampled by version 0, are not continued by version 1: they
    end at 4 tokens, truncated, out of the loss, and are counted; a cap of 2 lets them straddle."""
    samples, _ = run(policy, generation(partial_max_versions=1), range(2))
    dropped = samples[1]  # row 3 ended on its stop id in the first chunk: whole, not dropped
    assert dropped.dropped == [True, True, True, False] and dropped.truncated == [True, True, True, False]
    assert dropped.token_versions == [[0] * 4] * 3 + [[0, 0]]
    assert dropped.completion_masks() == [[0] * 4] * 3 + [[1, 1]]
    assert partial_metrics(dropped.version_figures())["partial/dropped"] == 3.0
    kept, _ = run(policy, generation(partial_max_versions=2), range(2))
    assert kept[1].dropped == [False] * 4 and kept[1].token_versions == [[0] * 4 + [1] * 4] * 3 + [[0, 0]]


def test_per_token_fields_line_up_with_the_batch_rows():
    sample = Sample(prompt_ids=[[5, 6], [7]], completion_ids=[[1, 2, 3], [4]], token_versions=[[0, 0, 1], [None]])
    assert sample.aligned(sample.token_versions, 0, 2, (2, 5), -1, torch.long).tolist() == [[-1, -1, 0, 0, 1],
                                                                                             [-1, -1, -1, -1, -1]]


@pytest.mark.parametrize("overrides, message", [
    (["generation.partial_rollouts=true"], "generation.partial_rollouts=true continues generations sampled ahead .* "
                                          "generation.max_staleness=0 samples none ahead"),
    (["generation.partial_rollouts=true", "generation.max_staleness=1", "generation.engine=hf"],
     "generation.max_staleness=1 .* needs an engine with its own copy of the weights"),
    (["generation.partial_chunk_tokens=4"], "generation.partial_chunk_tokens=4 shapes partial rollouts, which are off"),
    (["generation.partial_rollouts=true", "generation.max_staleness=1", "generation.partial_chunk_tokens=64"],
     "generation.partial_chunk_tokens=64 samples every completion in one chunk"),
    (["generation.partial_rollouts=true", "generation.max_staleness=1", "agent.tools=[m:f]"],
     "not built for multi-turn rollouts"),
])
def test_settings_that_cannot_act_are_refused_before_any_model_loads(overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, ["data.train=x.jsonl", "rewards=[{name: exact_match}]", "generation.engine=vllm",
                           *overrides], GRPOAlgoConfig)


def test_partial_rollouts_of_a_vision_language_model_are_refused(tiny_vlm_dir):
    """A chunk continues from the prompt's tokens alone: its images would be lost."""
    from posttrain.algorithms import ALGORITHMS
    from posttrain.models.vision import check_vision_recipe

    recipe = load_recipe(None, [f"model.name_or_path={tiny_vlm_dir}", "data.train=x.jsonl",
                                "rewards=[{name: exact_match}]", "generation.engine=vllm",
                                "generation.placement=servers", "generation.servers=[http://127.0.0.1:1]",
                                "generation.max_staleness=1", "generation.partial_rollouts=true"], GRPOAlgoConfig)
    with pytest.raises(UserError, match="generation.partial_rollouts=true with the vision-language model .*without "
                                        "its images"):
        check_vision_recipe(recipe, ALGORITHMS["grpo"][1](recipe))
