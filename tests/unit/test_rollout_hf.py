"""HFEngine specifics: mode and cache restored, the gather hook, weight loading, RNG isolation, engine table."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config.schema import GenerationConfig
from posttrain.errors import UserError
from posttrain.generation.base import Completions, SamplingParams
from posttrain.generation import make_engine
from posttrain.generation.hf import HFEngine

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in ("What is 3 + 4?", "Hi", "Tell me about the sea and the sky.")]


def test_restores_train_mode_and_use_cache(model, tokenizer, prompts):
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    model.train()
    seen = {}

    def spy(module, args, kwargs):
        seen.update(training=module.training, use_cache=module.config.use_cache)

    handle = model.register_forward_pre_hook(spy, with_kwargs=True)
    HFEngine(model, tokenizer).generate(prompts, GREEDY)
    handle.remove()
    assert seen == {"training": False, "use_cache": True}
    assert model.training and model.config.use_cache is False


def test_gather_is_entered_around_generation(model, tokenizer, prompts):
    events = []

    @contextlib.contextmanager
    def gather():
        events.append("enter")
        yield
        events.append("exit")

    handle = model.register_forward_pre_hook(lambda *_: events.append("forward"))
    HFEngine(model, tokenizer, gather=gather).generate(prompts, GREEDY)
    handle.remove()
    assert events[0] == "enter" and events[-1] == "exit"
    assert events.count("enter") == 1 and events.count("forward") >= GREEDY.max_new_tokens


def test_batch_size_chunks_give_the_same_completions(model, tokenizer, prompts):
    whole = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    calls = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    chunked = HFEngine(model, tokenizer, batch_size=2).generate(prompts, GREEDY)
    handle.remove()
    assert chunked.completion_ids == whole.completion_ids
    assert set(calls) == {2, 1}


def test_seed_leaves_global_rng_alone(model, tokenizer, prompts):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=4, seed=5))
    assert torch.equal(torch.rand(3), expected)


def test_model_generation_defaults_do_not_change_sampling(model, tokenizer, prompts):
    """A repetition penalty or min_new_tokens in generation_config.json would make the samples off-policy."""
    plain = HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=8, seed=3))
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.top_k = 2
    model.generation_config.min_new_tokens = 8
    assert HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=8, seed=3)) == plain


def test_load_weights_into_a_separate_model(tiny_model_dir, model, tokenizer, prompts):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    engine = HFEngine(model, tokenizer)
    engine.load_weights([list(policy.named_parameters())])
    assert engine.generate(prompts, GREEDY) == HFEngine(policy, tokenizer).generate(prompts, GREEDY)
    for (name, a), b in zip(policy.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_load_weights_from_the_same_model_is_a_no_op(model, tokenizer):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    HFEngine(model, tokenizer).load_weights([list(model.named_parameters())])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_load_weights_rejects_unknown_names_and_shapes(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    with pytest.raises(KeyError, match="no_such.weight"):
        engine.load_weights([[("no_such.weight", torch.zeros(1))]])
    name, param = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match=name):
        engine.load_weights([[(name, torch.zeros(param.shape[0] + 1))]])


def test_sleep_and_wake_are_harmless(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    before = engine.generate(prompts, GREEDY)
    engine.sleep()
    engine.wake()
    assert engine.generate(prompts, GREEDY) == before


def test_empty_inputs(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    assert engine.generate([], GREEDY) == Completions([], [], [])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], GREEDY)


def test_make_engine_picks_by_placement_and_engine(model, tokenizer):
    """One factory: generation.placement (+ engine) picks the engine; placement=ray takes the launch wing's URLs."""
    import dataclasses
    import types

    from posttrain.config.schema import Recipe
    from posttrain.generation.engines import ENGINES
    from posttrain.generation.server import ServerEngine

    backend = types.SimpleNamespace(unwrap=lambda m: m, gathered_parameters=contextlib.nullcontext, is_main=False, rank=0,
                                    world_size=1)
    recipe = Recipe()
    hf = make_engine(recipe, backend, model, tokenizer)
    assert isinstance(hf, HFEngine) and not hf.collective
    # on several ranks the policy is sharded: generating on it is a collective, every rank keeps in step
    assert make_engine(recipe, types.SimpleNamespace(**{**vars(backend), "world_size": 2}), model, tokenizer).collective
    with pytest.raises(UserError, match="cannot load an adapter alone"):
        hf.send_adapters({}, "run")
    listed = dataclasses.replace(recipe, generation=GenerationConfig(engine="vllm", placement="servers",
                                                                      servers=("http://127.0.0.1:9",)))
    engine = make_engine(listed, backend, model, tokenizer)  # built without contacting the server
    assert isinstance(engine, ServerEngine) and engine.servers == ["http://127.0.0.1:9"] and engine.holds_copy
    placed = dataclasses.replace(recipe, generation=GenerationConfig(engine="vllm", placement="ray"))
    assert make_engine(placed, backend, model, tokenizer, servers=["http://10.0.0.2:8000"]).servers == \
        ["http://10.0.0.2:8000"]
    assert set(ENGINES) == {("colocated", "hf"), ("colocated", "vllm"), ("node", "vllm"), ("servers", "vllm"),
                            ("ray", "vllm")}


def test_engines_declare_their_capabilities(model, tokenizer):
    from posttrain.generation.base import GenerationEngine

    hf = HFEngine(model, tokenizer)
    assert isinstance(hf, GenerationEngine)
    assert (hf.holds_copy, hf.shared, hf.outlives_run) == (False, False, False)
    hf.close()  # the defaults: nothing to let go of
    hf.end()


def test_sampling_params():
    cfg = GenerationConfig(max_completion_length=16, temperature=0.5, top_p=0.8, top_k=4)
    assert SamplingParams.from_config(cfg, seed=9) == SamplingParams(16, 0.5, 0.8, 4, 9)
    assert SamplingParams(temperature=0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.5).logprob_temperature == 0.5
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_completions_checks_lengths():
    with pytest.raises(ValueError, match="completion 0 has 2 tokens but 1 log-probs"):
        Completions([[1, 2]], [[0.0]], [False])
    with pytest.raises(ValueError, match="must match"):
        Completions([[1]], [[0.0]], [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_sampling_and_logprobs(model, tokenizer, prompts):
    model = model.cuda()
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=11)
    cuda_state = torch.cuda.get_rng_state()
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    assert first == second
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)  # the training RNG is left as it was
    for prompt, ids, logprobs in zip(prompts, first.completion_ids, first.logprobs):
        with torch.no_grad():
            logits_TV = model(torch.tensor([prompt + ids], device="cuda")).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits_TV.float() / 0.7, -1).gather(-1, torch.tensor(ids, device="cuda")[:, None])
        torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(-1).cpu(), atol=1e-3, rtol=0)


def test_a_second_eos_of_the_generation_config_ends_a_completion_not_truncated(model, tokenizer, prompts,
                                                                              eos_ids_model_dir):
    """The stop set is the tokenizer's eos and every eos of generation_config.json (models/load records it): a
    completion that ends on the second one is cut there and finished, not truncated."""
    from posttrain.config.schema import ModelConfig
    from posttrain.models.facts import stop_ids
    from posttrain.models.load import load_tokenizer

    params = SamplingParams(max_new_tokens=8, temperature=0)
    free = HFEngine(model, tokenizer).generate(prompts, params)
    assert free.truncated == [True] * len(prompts)  # nothing stopped the first run early
    second = free.completion_ids[0][3]
    model_dir = eos_ids_model_dir(second)
    loaded = load_tokenizer(ModelConfig(name_or_path=str(model_dir)))
    assert stop_ids(loaded) == (tokenizer.eos_token_id, second)
    out = HFEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), loaded).generate(prompts,
                                                                                                          params)
    for full, ids, cut in zip(free.completion_ids, out.completion_ids, out.truncated):
        expected = full[: full.index(second) + 1] if second in full else full
        assert ids == expected and cut == (second not in full)
    assert not out.truncated[0]
