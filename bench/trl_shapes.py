"""The data shapes bench/compare_trl.py runs, and the count of tokens each tool's trained forwards compute.

`--shape realistic` (issue 49) gives each algorithm the shape a shared prefix pays on, in the model's own tokens:
- grpo: prompts of about 384 tokens, three quarters of them one system prompt shared by every row, G = 8
  completions of up to 128 tokens, 16 completions (2 prompts) a step;
- dpo: pairs whose prompt is 40% of the pair's tokens (prompt : chosen : rejected = 4 : 3 : 3), rows of up to 512
  (about 460: a tenth under, so that neither tool cuts a row), 4 pairs a step;
- agents: GRPO whose system prompt carries tools' JSON schemas (as a template with tools renders them, written into
  the system message so that both tools and every model see the same tokens: as many of five tools as fit three
  quarters of about 512 tokens, at least one), a question after it, G = 8, completions of up to 128 tokens. The
  tools are not run: the model's turn is scored as it is (single turn), so the figures are those of the prompt the
  schemas make, not of tool calls.
`--shape small` keeps the flags as given (the historical short shapes).

`TrainedTokens` counts, in a tool's own process, the tokens that go through the input embeddings while autograd
records (the trained forwards; generation, reference and old-policy scores run without it): padding and a prompt
repeated per row count as computed, which is what they cost. It patches torch.nn.Embedding.forward for the run.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

REALISTIC = {
    "grpo": dict(prompt=384, gens=8, completion=128, bs=16),
    "agents": dict(prompt=512, gens=8, completion=128, bs=16),
    "dpo": dict(seq=512, bs=4),
}
"""The realistic shape's flags per algorithm (they replace --prompt, --gens, --completion, --seq and --bs)."""


def apply_shape(a) -> None:
    """--shape realistic: the algorithm's shape flags (REALISTIC) replace the ones given."""
    if a.shape == "realistic":
        for flag, value in REALISTIC[a.algo].items():
            setattr(a, flag, value)


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. "Paris" or "San Francisco, CA".
        unit: The temperature unit to answer in: celsius or fahrenheit.
    """
    return f"20 degrees {unit} in {city}"


def search_flights(origin: str, destination: str, date: str, passengers: int = 1) -> str:
    """Search the flights between two airports on a day.

    Args:
        origin: The IATA code of the departure airport, e.g. "CDG".
        destination: The IATA code of the arrival airport, e.g. "JFK".
        date: The day of the flight, as YYYY-MM-DD.
        passengers: How many seats are needed.
    """
    return "[]"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers and + - * / and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 30) * 2".
    """
    return "0"


def read_file(path: str, start_line: int = 1, end_line: int = 200) -> str:
    """Read lines of a text file of the user's project.

    Args:
        path: The file's path inside the project, e.g. "src/main.py".
        start_line: The first line to read (1-based).
        end_line: The last line to read.
    """
    return ""


def send_email(to: str, subject: str, body: str, cc: str = "") -> str:
    """Send an email on the user's behalf once they have confirmed it.

    Args:
        to: The recipient's address.
        subject: The subject line.
        body: The message, in plain text.
        cc: Addresses to copy, separated by commas.
    """
    return "sent"


TOOLS = (get_weather, search_flights, calculator, read_file, send_email)


def tools_system_prompt(tools: tuple = TOOLS) -> str:
    """A system message listing the tools' JSON schemas (transformers' get_json_schema) the way tool templates do."""
    from transformers.utils import get_json_schema

    schemas = "\n".join(json.dumps(get_json_schema(tool)) for tool in tools)
    return ("You are a helpful assistant with access to the following tools. To call one, answer with a JSON object "
            '{"name": <tool name>, "arguments": <its arguments>} inside <tool_call></tool_call> tags.\n<tools>\n'
            f"{schemas}\n</tools>")


def grpo_rows(say: Callable[[int], str], prompt: int) -> list[dict]:
    """GRPO prompts of about `prompt` words: one system prompt shared by all (three quarters, when long) and a
    question of their own, as chat messages; 12 keeps the historical short plain-text prompts."""
    if prompt <= 12:
        return [{"prompt": say(prompt), "answer": "yes"} for _ in range(2000)]
    system = say(prompt * 3 // 4)
    return [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": say(prompt // 4)}],
             "answer": "yes"} for _ in range(2000)]


def realistic_rows(algo: str, tokenizer, say: Callable[[int], str], a) -> list[dict]:
    """The rows of `--shape realistic` (module docstring), sized in the model's own tokens: words per token are
    measured on this tokenizer (a small locally trained one splits the bench's words into 2-3 tokens each)."""
    def tokens(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    per_word = tokens(say(400)) / 400

    def words(n: float) -> str:
        return say(max(1, round(n / per_word)))

    if algo == "dpo":  # prompt : chosen : rejected = 4 : 3 : 3, a tenth under the row's tokens
        return [{"prompt": words(a.seq * 0.9 * 4 / 7), "chosen": words(a.seq * 0.9 * 3 / 7),
                 "rejected": words(a.seq * 0.9 * 3 / 7)} for _ in range(2000)]
    if algo == "agents":  # as many tools' schemas as fit three quarters of the prompt (at least one)
        kept = [tool for k, tool in enumerate(TOOLS) if k == 0 or tokens(tools_system_prompt(TOOLS[: k + 1]))
                <= a.prompt * 3 // 4]
        system = tools_system_prompt(tuple(kept))
    else:
        system = words(a.prompt * 3 / 4)
    question = a.prompt - tokens(system)
    return [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": words(max(question, 16))}],
             "answer": "yes"} for _ in range(2000)]


class TrainedTokens:
    """Tokens embedded while autograd records, over the whole run (see the module docstring)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = None

    def __enter__(self) -> "TrainedTokens":
        original = self._original = torch.nn.Embedding.forward
        counter = self

        def counted(module, input_ids):
            if torch.is_grad_enabled():
                counter.count += input_ids.numel()
            return original(module, input_ids)

        torch.nn.Embedding.forward = counted
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.Embedding.forward = self._original
