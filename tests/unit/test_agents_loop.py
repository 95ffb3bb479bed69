"""The multi-turn rollout's token bookkeeping, against ids worked out by hand from the tiny tokenizer.

The engine here is scripted (it returns fixed ids) only to pin the expected ids; tests/integration/test_agents.py
runs the real hf engine.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from posttrain.agents import AgentLoop, ToolRunner, load_tools
from posttrain.agents.parsers import pick_parser

from posttrain.usercode import UserCodeError
from posttrain.generation.base import Completions, GenerationEngine, SamplingParams

TOOL_FILE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedEngine(GenerationEngine):
    """A GenerationEngine answering the n-th call with script[n] (one id list per prompt); records what it was sent."""

    def __init__(self, script: list[list[list[int]]]):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, params):
        self.calls.append(([list(p) for p in prompt_ids], params))
        out = self.script[len(self.calls) - 1]
        lps = [[-(k + 1) / 10 - 0.01 * len(self.calls) for k in range(len(ids))] for ids in out]
        return Completions(out, lps, [False] * len(out))

    def load_weights(self, buckets):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass


class Guess:
    """Scripted environment: says 'no' twice, then 'yes' and done; rewards 0.25 per step, 1 at the end."""

    def reset(self, row):
        self.steps = 0
        return [{"role": "user", "content": f"Guess {row['prompt']}"}]

    def step(self, message):
        self.steps += 1
        if self.steps == 3:
            return [], 1.0, True
        return [{"role": "user", "content": "no"}], 0.25, False


class BadReturn:
    def reset(self, row):
        return [{"role": "user", "content": "hi"}]

    def step(self, message):
        return "not a tuple"


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_scripted_engine_is_an_engine():
    assert isinstance(ScriptedEngine([]), GenerationEngine)


def test_three_turn_trajectory_ids_mask_and_logprobs_by_hand(tok):
    eos = tok.eos_token_id
    turn1, turn2, turn3 = [40, 41, eos], [42, eos], [43, 44, 45, eos]
    engine = ScriptedEngine([[turn1], [turn2], [turn3]])
    agent = AgentLoop(tok, engine, budget=200, max_turns=5, environment=Guess, environment_name="tests:Guess")
    [t] = agent.run([{"prompt": "1-9", "columns": {}}], [7], SamplingParams(max_new_tokens=50, seed=11))

    # by hand, from ChatML: the prompt, then after each engine turn the "\n" after <|im_end|>, the user turn, the
    # generation prompt
    prompt = ids(tok, "<|im_start|>user\nGuess 1-9<|im_end|>\n<|im_start|>assistant\n")
    user_no = ids(tok, "\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n")
    assert t.prompt_ids == prompt
    assert t.completion_ids == turn1 + user_no + turn2 + user_no + turn3
    assert t.completion_mask == [1] * 3 + [0] * len(user_no) + [1] * 2 + [0] * len(user_no) + [1] * 4
    n = len(user_no)
    expected_lps = [-0.11, -0.21, -0.31] + [0.0] * n + [-0.12, -0.22] + [0.0] * n + [-0.13, -0.23, -0.33, -0.43]
    assert t.logprobs == pytest.approx(expected_lps)
    # token in: each turn continues from exactly the ids so far; seeds step per turn
    assert [c[0] for c in engine.calls] == [[prompt], [prompt + turn1 + user_no],
                                            [prompt + turn1 + user_no + turn2 + user_no]]
    assert [c[1].seed for c in engine.calls] == [11, 12, 13]
    assert [c[1].max_new_tokens for c in engine.calls] == [200, 200 - 3 - n, 200 - 5 - 2 * n]
    assert (t.turns, t.truncated, t.finished, t.env_reward) == (3, False, True, 1.5)
    assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_trained_ids_are_the_engines_even_where_decode_and_encode_disagree(tok):
    """'the' is one token of the tiny tokenizer; the engine spells it t-h-e. Decoding and encoding again would give
    other ids; the trajectory keeps the engine's."""
    spelled = [tok.convert_tokens_to_ids(c) for c in "the"] + [tok.eos_token_id]
    assert ids(tok, tok.decode(spelled[:-1])) != spelled[:-1]  # the drift is real
    engine = ScriptedEngine([[spelled]])
    agent = AgentLoop(tok, engine, budget=100, max_turns=1)
    [t] = agent.run([{"prompt": [{"role": "user", "content": "x"}], "columns": {}}], [0], SamplingParams())
    assert t.completion_ids == spelled and t.completion_mask == [1, 1, 1, 1]
    assert t.final_text == "the"


def test_budget_cuts_and_flags_the_trajectory(tok):
    eos = tok.eos_token_id
    engine = ScriptedEngine([[[40, eos]], [[41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]])
    user_no = ids(tok, "\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n")
    budget = 2 + len(user_no) + 3
    agent = AgentLoop(tok, engine, budget=budget, max_turns=5, environment=Guess, environment_name="tests:Guess")
    [t] = agent.run([{"prompt": "a", "columns": {}}], [0], SamplingParams())
    assert t.completion_ids == [40, eos] + user_no + [41, 42, 43]
    assert t.completion_mask == [1, 1] + [0] * len(user_no) + [1, 1, 1]
    assert t.truncated and t.finished and t.turns == 2


def test_max_turns_stops_and_the_last_turns_calls_are_not_run(tok, tmp_path):
    (tmp_path / "addtool.py").write_text(TOOL_FILE)
    tools = load_tools((f"{tmp_path / 'addtool.py'}:add",))
    call = ids(tok, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') + [tok.eos_token_id]
    engine = ScriptedEngine([[call, call], [call, call]])
    agent = AgentLoop(tok, engine, budget=900, max_turns=2, tools=tools, parser=pick_parser("hermes", ""),
                         runner=ToolRunner(tools, 5.0, 100, 2))
    out = agent.run([{"prompt": "q", "columns": {}}] * 2, [0, 0], SamplingParams())
    for t in out:
        assert t.turns == 2 and t.tool_calls == 1 and t.tool_errors == 0  # the second turn's call is not run
        assert t.messages[2] == {"role": "tool", "name": "add", "content": "5"}
        tool_ids = ids(tok, "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
        assert t.completion_ids == call + tool_ids + call
        assert t.completion_mask == [1] * len(call) + [0] * len(tool_ids) + [1] * len(call)
        assert not t.truncated
    assert len(engine.calls) == 2 and len(engine.calls[1][0]) == 2  # both trajectories in one call per turn
    assert tok.decode(out[0].prompt_ids).count('"name": "add"') == 1  # the tools are shown


def test_environment_returning_wrong_types_names_it_and_the_sample(tok):
    engine = ScriptedEngine([[[40, tok.eos_token_id]]])
    agent = AgentLoop(tok, engine, budget=50, max_turns=3, environment=BadReturn, environment_name="my:BadReturn")
    with pytest.raises(UserCodeError, match=r"agent.environment 'my:BadReturn' \(sample: dataset row 12\).step"):
        agent.run([{"prompt": "a", "columns": {}}], [12], SamplingParams())


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    class Rewriting:
        """Renders each message's content with the number of messages so far (earlier turns change)."""

        chat_template = "x"
        eos_token_id = tok.eos_token_id

        def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
            return "".join(f"{m['role']}{len(messages)}:{m['content']}|" for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return tok(text, add_special_tokens=False)

    agent = AgentLoop(Rewriting(), ScriptedEngine([]), budget=50, max_turns=2)
    with pytest.raises(UserCodeError, match="renders the earlier turns"):
        agent.delta_ids([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                        [{"role": "user", "content": "c"}])


def test_a_turn_cut_at_max_turn_tokens_is_closed_by_an_untrained_end_of_turn(tok):
    eos = tok.eos_token_id
    engine = ScriptedEngine([[[40, 41]], [[42, eos]], [[43, eos]]])
    agent = AgentLoop(tok, engine, budget=200, max_turns=5, environment=Guess, environment_name="tests:Guess",
                         max_turn_tokens=2)
    [t] = agent.run([{"prompt": "a", "columns": {}}], [0], SamplingParams())
    user_no = ids(tok, "\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n")
    assert t.completion_ids == [40, 41, eos] + user_no + [42, eos] + user_no + [43, eos]
    assert t.completion_mask == [1, 1, 0] + [0] * len(user_no) + [1, 1] + [0] * len(user_no) + [1, 1]
    assert [c[1].max_new_tokens for c in engine.calls] == [2, 2, 2]
    assert (t.cut_turns, t.truncated, t.turns) == (1, False, 3)


def test_agents_never_import_the_loop_or_the_composition_root():
    from pathlib import Path

    from tests.unit.test_imports import imported_modules

    package = Path(__file__).resolve().parents[2] / "posttrain" / "agents"
    for path in package.glob("*.py"):
        bad = [m for _, m in imported_modules(path.read_text()) if m.startswith(("posttrain.train", "posttrain.run"))]
        assert not bad, f"{path.name} imports {bad}; agents/ sits below train/ and run.py"


def test_gae_passes_over_appended_tokens_as_if_they_were_not_there():
    """PPO on a trajectory: advantages and returns at the model's tokens equal those of the same row with the tool /
    environment tokens removed (the value after a model token is the value at the next model token)."""
    import torch

    from posttrain.ops.advantages import gae

    rewards = torch.tensor([[0.1, 0.0, 0.0, -0.2, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.3, 9.0, 0.7]])
    mask = torch.tensor([[1, 0, 0, 1, 0, 1]])
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    kept = mask[0].bool()
    adv_ref, ret_ref = gae(rewards[:, kept], values[:, kept], torch.ones(1, 3), 0.9, 0.8)
    assert torch.allclose(adv[:, kept], adv_ref) and torch.allclose(ret[:, kept], ret_ref)
    assert (adv[:, ~kept] == 0).all()
    # by hand: A2 = 1 - 0.7 = 0.3; A1 = -0.2 + 0.9*0.7 - 0.3 + 0.72*0.3 = 0.346; A0 = 0.1 + 0.27 - 0.5 + 0.72*0.346
    assert adv[0, kept].tolist() == pytest.approx([0.1 + 0.9 * 0.3 - 0.5 + 0.72 * 0.346, 0.346, 0.3])


def test_a_rank_whose_trajectories_ended_keeps_joining_the_engine_calls(tok):
    """Rank A's trajectory ends after 1 turn, rank B's (simulated by active_anywhere) after 3: A makes 3 calls, the
    last two one-token pads that add nothing to its trajectory; with no rank active both stop."""
    eos = tok.eos_token_id
    others = iter([1, 1, 1, 0])  # rank B's active trajectories at each turn
    engine = ScriptedEngine([[[40, eos]], [[7]], [[7]]])
    agent = AgentLoop(tok, engine, budget=50, max_turns=5, active_anywhere=lambda n: n + next(others))
    [t] = agent.run([{"prompt": "a", "columns": {}}], [0], SamplingParams(max_new_tokens=9))
    assert t.completion_ids == [40, eos] and t.turns == 1
    assert [c[0] for c in engine.calls[1:]] == [[[eos]], [[eos]]]
    assert [c[1].max_new_tokens for c in engine.calls[1:]] == [1, 1]


def test_a_turn_ending_on_the_generation_configs_second_eos_is_closed(eos_ids_model_dir):
    """Llama-3.1 ends a tool-calling turn with <|eom_id|>, its generation config's second eos: here token 7."""
    from posttrain.config.schema import ModelConfig
    from posttrain.models.load import load_tokenizer

    tok = load_tokenizer(ModelConfig(name_or_path=str(eos_ids_model_dir(7))))
    agent = AgentLoop(tok, ScriptedEngine([[[40, 7]]]), budget=100, max_turns=1)
    [t] = agent.run([{"prompt": [{"role": "user", "content": "x"}], "columns": {}}], [0], SamplingParams())
    assert t.completion_ids == [40, 7] and not t.truncated and t.cut_turns == 0
    assert t.final_text == tok.decode([40])


def test_no_turn_limit_runs_until_a_turn_calls_no_tool_or_the_budget_is_used(tok, tmp_path):
    """agent.max_turns null (TRL's unset max_tool_calling_iterations): six rounds of tool calls then an answer is
    seven turns, more than the default limit of 4; with calls only, the completion budget ends it."""
    (tmp_path / "addtool.py").write_text(TOOL_FILE)
    tools = load_tools((f"{tmp_path / 'addtool.py'}:add",))
    call = ids(tok, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') + [tok.eos_token_id]
    answer = [40, tok.eos_token_id]
    engine = ScriptedEngine([[call]] * 6 + [[answer]])
    agent = AgentLoop(tok, engine, budget=2000, max_turns=None, tools=tools, parser=pick_parser("hermes", ""),
                      runner=ToolRunner(tools, 5.0, 100, 2))
    [t] = agent.run([{"prompt": "q", "columns": {}}], [0], SamplingParams())
    assert t.turns == 7 and t.tool_calls == 6 and not t.truncated and t.completion_ids[-2:] == answer
    engine = ScriptedEngine([[call]] * 100)
    budget = 4 * len(call)
    agent = AgentLoop(tok, engine, budget=budget, max_turns=None, tools=tools, parser=pick_parser("hermes", ""),
                      runner=ToolRunner(tools, 5.0, 100, 2))
    [t] = agent.run([{"prompt": "q", "columns": {}}], [0], SamplingParams())
    assert t.truncated and len(t.completion_ids) == budget and len(engine.calls) <= 4  # of 100 scripted turns
