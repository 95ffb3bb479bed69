"""Start-up checks of `rollout:` (before any model loads): tools import and have schemas, the chat template shows
tools to the model and renders tool messages, the parser and the environment load."""

from __future__ import annotations

from posttrain.agents.loop import environment_class
from posttrain.agents.parsers import pick_parser
from posttrain.agents.tools import load_tools
from posttrain.errors import UserError

MULTI_TURN_COMMANDS = ("grpo", "ppo")


def check_agent(recipe, tokenizer, command: str) -> None:
    """UserError naming what is wrong with recipe.agent for this tokenizer; nothing when rollout is off."""
    r = recipe.agent
    if not r.enabled:
        return
    if command not in MULTI_TURN_COMMANDS:
        raise UserError(f"agent.tools / agent.environment: multi-turn rollouts run under "
                        f"{', '.join(MULTI_TURN_COMMANDS)}, not {command}; remove the rollout section")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("agent.tools / agent.environment need a chat template to format the turns; set "
                        "model.chat_template")
    if r.environment:
        environment_class(recipe, tokenizer)
    tools = load_tools(r.tools)
    if not tools:
        return
    pick_parser(r.tool_parser, tokenizer.chat_template)
    schemas = [t.schema for t in tools.values()]
    probe = [{"role": "user", "content": "probe"}]
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        tokenizer.apply_chat_template(probe + [{"role": "assistant", "content": "a"},
                                               {"role": "tool", "name": next(iter(tools)), "content": "b"}],
                                      tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises its own types for a template that cannot do this
        raise UserError(f"agent.tools: the chat template cannot render tool messages ({type(e).__name__}: {e}); "
                        "set model.chat_template to a template with tool support") from None
    if with_tools == without:
        raise UserError("agent.tools: the chat template ignores tools (it renders the same text with and without "
                        "them), so the model would never see them; set model.chat_template to a template with tool "
                        "support")
