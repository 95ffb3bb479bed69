"""The multi-turn rollout: the model's turns from the engine, tool / environment turns from the chat template.

    agent = AgentLoop.from_recipe(recipe, tokenizer, engine)      # any GenerationEngine: hf, vllm, server
    trajectories = agent.run(examples, dataset_rows, SamplingParams(max_new_tokens=..., seed=...))
    t = trajectories[0]
    t.prompt_ids + t.completion_ids          # the trained sequence
    t.completion_mask                        # 1 on the engine's tokens only
    t.logprobs                               # the engine's log-probs on those tokens, 0.0 elsewhere

Token in, token out: each turn the engine continues from the ids of the trajectory so far (its own ids plus the
tokenised messages appended), and its ids are kept as they came. The model's text is decoded only to read tool
calls and to hand the turn to the environment and the rewards; it is never encoded again. The appended messages
are tokenised as the chat template's delta: the conversation is rendered and tokenised with and without them, and
the new suffix (after the separator the template puts behind the end-of-turn token, ChatML's "\\n") is appended. A
template that renders the earlier turns differently once more are added is refused (the suffix would not be
where the tokens are).

The trajectory's budget is `generation.max_completion_length` tokens after the prompt, model and appended tokens
together (so the engine's prompt + completion limit holds); a trajectory that reaches it is cut there and flagged
truncated (`algo.mask_truncated_completions` leaves it out of the loss). All the active trajectories take their next
turn in one engine call, so one that calls many tools does not hold the others back by more than a turn.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

from posttrain.agents.environment import EnvironmentSession, load_environment
from posttrain.agents.openenv_env import is_openenv_spec, openenv_environment
from posttrain.agents.verifiers_env import NAME as VERIFIERS, check_verifiers_environment, verifiers_environment
from posttrain.agents.parsers import pick_parser
from posttrain.agents.tools import ToolRunner, load_tools
from posttrain.generation.base import GenerationEngine, SamplingParams
from posttrain.models.facts import stop_ids
from posttrain.usercode import UserCodeError

logger = logging.getLogger(__name__)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    """The opening messages, templated with the tools and a generation prompt."""
    messages: list[dict]
    """The conversation as text (for rewards and the samples file; never tokenised again)."""
    opening: int = 0
    """How many of `messages` opened it (the prompt); the rest is what rewards get as the completion."""
    completion_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: the engine's ids and the appended messages' ids, in order."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each of its tokens; 0.0 at appended tokens."""
    completion_mask: list[int] = field(default_factory=list)
    """1 at the engine's tokens (trained), 0 at appended tokens."""
    truncated: bool = False
    """The trajectory reached its token budget and was cut."""
    finished: bool = False
    """No further turn: the model answered without a tool call, the environment said done, or a limit was hit."""
    env_reward: float = 0.0
    """Sum of the environment's step rewards."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that failed: unreadable, unknown tool, bad arguments, raised, crashed, timed out."""
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    cut_turns: int = 0
    """Turns that reached agent.max_turn_tokens and were closed by the template's end-of-turn token."""
    tools: Optional[list] = None
    """The tool schemas its prompt shows (the row's `tools` and agent.tools'); every turn is rendered with them."""
    prompt_truncated: bool = False
    """Its templated prompt was over the prompt limit and lost its first tokens."""

    def append(self, ids: list[int], logprobs: Optional[list[float]], budget: int) -> bool:
        """Add ids (the engine's when logprobs is given), cut at the budget; finished once the budget is full.
        Returns whether all of them fit."""
        room = budget - len(self.completion_ids)
        kept = ids[:room]
        self.completion_ids += kept
        self.logprobs += logprobs[: len(kept)] if logprobs is not None else [0.0] * len(kept)
        self.completion_mask += [int(logprobs is not None)] * len(kept)
        self.finished = self.finished or len(self.completion_ids) >= budget
        return len(kept) == len(ids)

    @property
    def completion_messages(self) -> list[dict]:
        """Every message after the opening ones: the model's turns and the tool / environment turns between them, as
        TRL's multi-turn GRPO passes a completion to reward functions."""
        return self.messages[self.opening:]

    @property
    def final_text(self) -> str:
        """The model's last turn (what rewards score as the completion)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    def stats(self) -> dict:
        return dict(turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                    tool_timeouts=self.tool_timeouts, tool_seconds=self.tool_seconds, truncated=self.truncated,
                    cut_turns=self.cut_turns, prompt_truncated=self.prompt_truncated)


def environment_class(recipe, tokenizer) -> Optional[type]:
    """agent.environment -> the class made per sample: the user's 'module:Class', `verifiers`: the data's verifiers
    tasks (agents/verifiers_env.py), reading tool calls with agent.tool_parser, or `openenv:<where>`: an OpenEnv
    server, started here when local (agents/openenv_env.py)."""
    r = recipe.agent
    if r.environment == VERIFIERS:
        parse = pick_parser(r.tool_parser, tokenizer.chat_template, r.user_code_timeout)
        return verifiers_environment(check_verifiers_environment(recipe), parse)
    if is_openenv_spec(r.environment):
        return openenv_environment(r.environment, r.user_code_timeout)
    return load_environment(r.environment) if r.environment else None


class AgentLoop:
    """Multi-turn rollouts over any GenerationEngine (see the module docstring)."""

    def __init__(self, tokenizer, engine: GenerationEngine, budget: int, max_turns: Optional[int], tools=None,
                 parser=None, runner: Optional[ToolRunner] = None, environment: Optional[type] = None,
                 environment_name: str = "",
                 max_prompt_length: Optional[int] = None, max_turn_tokens: Optional[int] = None,
                 active_anywhere: Optional[Callable[[int], int]] = None, user_code_timeout: float = 60.0):
        """active_anywhere: sums this rank's count of active trajectories over the ranks, for an engine whose
        generate is a collective (hf under ZeRO-3 / FSDP2 gathers parameters): a rank whose trajectories have all
        finished keeps joining the calls (one token from a one-token prompt) while another rank's go on."""
        self.tokenizer, self.engine, self.budget, self.max_turns = tokenizer, engine, budget, max_turns
        self.tools, self.parser, self.runner = tools or {}, parser, runner
        self.schemas = [t.schema for t in self.tools.values()] or None
        self.environment, self.environment_name = environment, environment_name
        self.max_prompt_length, self.max_turn_tokens = max_prompt_length, max_turn_tokens
        self.active_anywhere = active_anywhere
        self.user_code_timeout = user_code_timeout
        self.stop_ids = stop_ids(tokenizer)  # the end-of-turn tokens (Llama-3.1 ends a tool call with <|eom_id|>)

    @classmethod
    def from_recipe(cls, recipe, tokenizer, engine: GenerationEngine,
                    active_anywhere: Optional[Callable[[int], int]] = None) -> "AgentLoop":
        r = recipe.agent
        tools = load_tools(r.tools)
        return cls(tokenizer, engine, budget=recipe.generation.max_completion_length, max_turns=r.max_turns,
                   tools=tools, parser=pick_parser(r.tool_parser, tokenizer.chat_template, r.user_code_timeout)
                   if tools else None,
                   runner=ToolRunner(tools, r.tool_timeout, r.tool_max_output_chars, r.tool_workers),
                   environment=environment_class(recipe, tokenizer),
                   environment_name=r.environment or "",
                   # the bound the engines are sized for (a vLLM engine's max_model_len: models.facts.longest_sequence)
                   max_prompt_length=recipe.data.max_prompt_length or recipe.data.max_length,
                   max_turn_tokens=r.max_turn_tokens, active_anywhere=active_anywhere,
                   user_code_timeout=r.user_code_timeout)

    # --- tokens ------------------------------------------------------------------------------------------------------

    def _encode(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list] = None) -> list[int]:
        """tools: the trajectory's schemas (None: agent.tools')."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools or self.schemas, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja raises its own types (raise_exception in the template)
            roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
            raise UserCodeError(f"the chat template cannot render a conversation with the roles {roles} "
                                f"({type(e).__name__}: {e}); set model.chat_template to one that renders them") from e
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict], tools: Optional[list] = None) -> tuple[list[int], bool]:
        """The opening messages templated with a generation prompt, and whether they were cut to the prompt limit
        (their first tokens dropped; counted per step as truncated_prompts)."""
        ids = self._encode(messages, add_generation_prompt=True, tools=tools)
        limit = self.max_prompt_length
        if limit is None or len(ids) <= limit:
            return ids, False
        if not getattr(self, "_warned_cut", False):  # the tools turn (JSON schemas) can be most of a prompt
            logger.warning("a templated prompt (tools turn included) has %d tokens, over data.max_prompt_length (or "
                           "data.max_length) = %d: its first tokens are cut; raise that limit to keep them",
                           len(ids), limit)
            self._warned_cut = True
        return ids[len(ids) - limit:], True

    def delta_ids(self, messages: list[dict], new: list[dict], closed: bool = True,
                  tools: Optional[list] = None) -> list[int]:
        """The ids `new` adds after `messages` (which end with the model's turn), up to the next generation prompt;
        closed: the engine's turn ended with the end-of-turn token (else it is part of the delta)."""
        before = self._encode(messages, add_generation_prompt=False, tools=tools)
        after = self._encode(messages + new, add_generation_prompt=True, tools=tools)
        if after[: len(before)] != before:
            raise UserCodeError("the chat template renders the earlier turns of a conversation differently once a "
                            f"{new[0]['role']} message is added, so the appended tokens cannot be found exactly; use "
                            "a template with the prefix property (model.chat_template)")
        # the engine stopped at the end-of-turn token; what the template puts after it ("\n") is appended here
        last_eos = max((i for i, t in enumerate(before) if t in self.stop_ids), default=len(before) - 1)
        return before[last_eos + int(closed) :] + after[len(before):]

    # --- the rollout -------------------------------------------------------------------------------------------------

    def run(self, examples: list[dict], rows: list[int], params: SamplingParams) -> list[Trajectory]:
        """One trajectory per example (a prompt's G samples are G entries); rows: their dataset rows (for errors)."""
        sessions = [EnvironmentSession(self.environment, self.environment_name, row, self.user_code_timeout)
                    if self.environment else None for row in rows]
        trajectories = [self._open(e, s) for e, s in zip(examples, sessions)]
        # no turn limit of its own (TRL's): each turn takes at least one token of the budget, so `budget` turns at most
        max_turns = self.max_turns if self.max_turns is not None else self.budget
        for turn in range(max_turns):
            active = [i for i, t in enumerate(trajectories) if not t.finished]
            if not (self.active_anywhere(len(active)) if self.active_anywhere else active):
                break
            if not active:  # other ranks go on: join their collective generate call
                self.engine.generate([[self.stop_ids[0]]], dataclasses.replace(params, max_new_tokens=1))
                continue
            room = max(self.budget - len(trajectories[i].completion_ids) for i in active)
            room = min(room, self.max_turn_tokens or room)
            turn_params = dataclasses.replace(params, max_new_tokens=room,
                                              seed=None if params.seed is None else (params.seed + turn) % 2**62)
            out = self.engine.generate([trajectories[i].prompt_ids + trajectories[i].completion_ids for i in active],
                                       turn_params)
            last = turn == max_turns - 1
            replies = [self._take_turn(trajectories[i], out.completion_ids[k], out.logprobs[k])
                       for k, i in enumerate(active)]
            self._run_tools([trajectories[i] for i in active], replies, skip=last)
            for k, i in enumerate(active):
                t, message = trajectories[i], replies[k]
                new = message.pop("_tool_messages", [])
                t.messages.append({"role": "assistant", "content": message["content"]})
                if t.finished:  # cut mid-turn, or its turn filled the budget
                    continue
                closed = message.pop("closed")
                done = not new
                if sessions[i] is not None:
                    env_messages, reward, done = sessions[i].step(dict(message))
                    t.env_reward += reward
                    new += env_messages
                if done or last or not new:
                    t.finished = True
                    continue
                fits = t.append(self.delta_ids(t.messages, new, closed=closed, tools=t.tools), None, self.budget)
                t.truncated = not fits or len(t.completion_ids) >= self.budget  # no room left for the model
                t.messages += new
        return trajectories

    def _open(self, example: dict, session: Optional[EnvironmentSession]) -> Trajectory:
        """An example from tokenize_prompts(rollout_tools=...) holds its opening chat and ids (cut and counted
        there); an environment's reset, or an example without them, is templated here."""
        tools = example.get("tools") or self.schemas
        if session is None and "messages" in example:
            return Trajectory(list(example["prompt_ids"]), [dict(m) for m in example["messages"]],
                              opening=len(example["messages"]), tools=tools)
        if session is not None:
            messages = session.reset({"prompt": example["prompt"], **example.get("columns", {})})
        elif isinstance(example["prompt"], str):
            messages = [{"role": "user", "content": example["prompt"]}]
        else:
            messages = [dict(m) for m in example["prompt"]]
        ids, cut = self.prompt_ids(messages, tools)
        return Trajectory(ids, list(messages), opening=len(messages), tools=tools, prompt_truncated=cut)

    def _take_turn(self, t: Trajectory, ids: list[int], logprobs: list[float]) -> dict:
        """Keep the engine's ids; the turn as a message (text decoded only to be read)."""
        t.turns += 1
        kept = ids[: self.budget - len(t.completion_ids)]
        ended = bool(kept) and kept[-1] in self.stop_ids
        t.append(ids, logprobs, self.budget)
        if not ended and t.finished:  # the budget cut it before its end-of-turn token: no further turn
            t.truncated = True
        elif not ended:  # agent.max_turn_tokens cut it: the delta closes it with the end-of-turn token
            t.cut_turns += 1
        text = self.tokenizer.decode(kept[:-1] if ended else kept, skip_special_tokens=False)
        return {"role": "assistant", "content": text, "closed": ended}

    def _run_tools(self, trajectories: list[Trajectory], replies: list[dict], skip: bool) -> None:
        """Parse every reply's tool calls and run them all together; results go in reply['_tool_messages']."""
        if self.parser is None:
            return
        calls, owners = [], []
        for k, (t, reply) in enumerate(zip(trajectories, replies)):
            found, errors = self.parser(reply["content"])
            reply["tool_calls"] = found
            if skip or t.finished:  # no turn left to read the results in
                continue
            reply["_tool_messages"] = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
            t.tool_calls += len(found) + len(errors)
            t.tool_errors += len(errors)
            calls += found
            owners += [k] * len(found)
        for k, call, result in zip(owners, calls, self.runner.run(calls)):
            t = trajectories[k]
            t.tool_errors += result.error
            t.tool_timeouts += result.timed_out
            t.tool_seconds += result.seconds
            replies[k]["_tool_messages"].append({"role": "tool", "name": str(call.get("name")),
                                                 "content": result.content})
