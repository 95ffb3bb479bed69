"""load_reward / load_rewards: built-ins, import paths, classes, and the messages for specs that cannot work."""

from __future__ import annotations

import functools
import sys
import textwrap

import pytest

from posttrain.config.schema import RewardConfig
from posttrain.errors import UserError
from posttrain.rewards.builtin import exact_match
from posttrain.rewards.combine import Reward, RewardSet
from posttrain.rewards.load import load_reward, load_rewards

MODULE = """
CALLS = []

def has_word(prompts, completions, word="yes", **columns):
    return [float(word in c) for c in completions]

def two_args(prompts, completions):
    return [1.0] * len(completions)

class Scorer:
    def __init__(self, bonus=0.0):
        CALLS.append(bonus)
        self.bonus = bonus

    def __call__(self, prompts, completions, **columns):
        return [len(c) + self.bonus for c in completions]

class Broken:
    def __init__(self):
        raise RuntimeError("no licence key")

class Quits:
    def __init__(self):
        import sys
        sys.exit(0)

NOT_CALLABLE = 3

def star_args(*args):
    return [1.0] * 3

def column_only(answer):
    return [1.0] * len(answer)

class StarCall:
    def __call__(self, *args, flag=False):
        return [1.0]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "raises_on_import.py").write_text("raise ImportError('needs sympy')\n")
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_builtin_with_kwargs():
    reward = load_reward(RewardConfig(name="exact_match", kwargs={"answer_column": "solution"}, weight=2.0, timeout=5))
    assert isinstance(reward, Reward)
    assert (reward.name, reward.weight, reward.timeout, reward.on_error) == ("exact_match", 2.0, 5.0, "raise")
    assert isinstance(reward.fn, functools.partial) and reward.fn.func is exact_match
    assert reward.fn(completions=["#### 4"], solution=["4"]) == [1.0]


def test_import_path_function(user_module):
    reward = load_reward(RewardConfig(name=f"{user_module}:has_word", kwargs={"word": "maybe"}, on_error="skip"))
    assert reward.name == "has_word" and reward.on_error == "skip"
    assert reward.fn(["q", "q"], ["maybe so", "yes"]) == [1.0, 0.0]


def test_import_path_class_is_built_once_with_kwargs(user_module):
    reward = load_reward(RewardConfig(name=f"{user_module}:Scorer", kwargs={"bonus": 0.5}))
    module = sys.modules[user_module]
    assert module.CALLS == [0.5] and reward.name == "Scorer"
    assert reward.fn(["q"], ["abc"]) == [3.5]
    assert module.CALLS == [0.5]


def test_file_path(tmp_path):
    path = tmp_path / "my_file_rewards.py"
    path.write_text(
        "def short(prompts, completions, **columns):\n    return [float(len(c) < 3) for c in completions]\n"
    )
    reward = load_reward(RewardConfig(name=f"{path}:short"))
    assert reward.fn(["q", "q"], ["ab", "abcd"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        (
            "no_such_module_xyz:fn",
            {},
            "reward 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz': it raised ModuleNotFoundError",
        ),
        ("raises_on_import:fn", {}, "cannot import module 'raises_on_import': it raised ImportError: needs sympy"),
        ("{m}:has_wrd", {}, "has no attribute 'has_wrd'; did you mean 'has_word'"),
        ("{m}:NOT_CALLABLE", {}, "'NOT_CALLABLE' is a int, not a function or class"),
        ("{m}:two_args", {"word": "x"}, "does not take the kwargs \\['word'\\] the recipe gives it"),
        ("{m}:Broken", {}, "Broken\\(\\*\\*kwargs\\) raised RuntimeError: no licence key"),
        ("/no/such/file.py:fn", {}, "file /no/such/file.py does not exist"),
        (
            "exact_mach",
            {},
            "neither a built-in reward .* nor an import path .*; did you mean 'exact_match'",
        ),
        ("format", {"patern": "x"}, "unknown kwarg 'patern'; did you mean 'pattern'"),
    ],
)
def test_bad_specs_fail_at_load_naming_the_spec(user_module, spec, kwargs, message):
    with pytest.raises(UserError, match=message):
        load_reward(RewardConfig(name=spec.format(m=user_module), kwargs=kwargs))


def test_bad_policy_values():
    with pytest.raises(UserError, match="on_error must be raise or skip"):
        load_reward(RewardConfig(name="exact_match", on_error="ignore"))
    with pytest.raises(UserError, match="timeout must be > 0"):
        load_reward(RewardConfig(name="exact_match", timeout=0))


def test_load_rewards_makes_names_unique_and_scores(user_module):
    rewards = load_rewards(
        [
            RewardConfig(name="format", kwargs={"pattern": "y.*"}, weight=0.5),
            RewardConfig(name="format", kwargs={"pattern": ".*s"}, weight=0.25),
            RewardConfig(name=f"{user_module}:has_word"),
            RewardConfig(name="exact_match"),
        ]
    )
    assert isinstance(rewards, RewardSet)
    assert rewards.names == ["format", "format_2", "has_word", "exact_match"]
    total, per_function, skipped, _ = rewards.score(["q", "q"], ["yes", "no 7"], {"answer": ["x", "7"]})
    # yes: 0.5 * 1 + 0.25 * 1 + 1 + 0 ; no 7: 0 + 0 + 0 + 1
    assert total.tolist() == [1.75, 1.0] and skipped == 0


@pytest.mark.parametrize("spec, message", [
    ("exits_on_import:fn", r"(?s)cannot import module 'exits_on_import': it called sys.exit\(0\)\n  File .*exits_on_import.py"),
    ("{m}:Quits", r"Quits\(\*\*kwargs\) called sys.exit\(0\)"),
])
def test_sys_exit_in_user_code_at_load_is_an_input_error_not_a_silent_exit(user_module, spec, message):
    with pytest.raises(UserError, match=message):
        load_reward(RewardConfig(name=spec.format(m=user_module)))


@pytest.mark.parametrize("spec", ["subprocess:getoutput", "os:system", "builtins:eval", "builtins:exec", "os.system",
                                  "builtins:open", "{m}:star_args", "{m}:column_only", "{m}:StarCall"])
def test_a_callable_that_takes_none_of_the_contract_is_refused_at_load(user_module, spec):
    """A callable that takes none of prompts / completions / completion_ids / ... and no **kwargs is refused when the
    rewards load (preflight, before any model), naming it; it is never called (os.system would run a column)."""
    with pytest.raises(UserError, match=r"reward '.*' cannot be a reward function: it takes \(.*\): none of the "
                                        r"reward contract's arguments .* and no \*\*kwargs"):
        load_reward(RewardConfig(name=spec.format(m=user_module)))


@pytest.mark.parametrize("spec", ["{m}:has_word", "{m}:two_args", "{m}:Scorer"])
def test_contract_functions_and_the_earlier_positional_contract_still_load(user_module, spec):
    assert load_reward(RewardConfig(name=spec.format(m=user_module))).fn is not None


@pytest.mark.parametrize("kwargs, key", [({"max_length": 8, "buffer": 4, "penalty_factor": 1e39}, "penalty_factor"),
                                         ({"max_length": 8, "buffer": 4, "penalty_factor": float("inf")},
                                          "penalty_factor"),
                                         ({"target_length": 4, "max_length": 1e39}, "max_length")])
def test_a_builtins_number_that_float32_cannot_hold_is_refused_at_load(kwargs, key):
    name = "overlong" if "buffer" in kwargs else "length_penalty"
    with pytest.raises(UserError, match=f"reward {name}: kwargs.{key} is .*not a finite float32"):
        load_reward(RewardConfig(name=name, kwargs=kwargs))
