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
import random
from pathlib import Path
from typing import Callable

import torch

SIZES = {  # Llama shapes; vocab None keeps the locally trained tokenizer's vocabulary
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab=None),
    "5m": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688, vocab=None),
    "vocab": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688, vocab=151936),
    "20m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408, vocab=None),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab=151936),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960, vocab=151936),
}
VOCAB_WORDS = ("one two three four five six seven eight nine ten the a cat dog tree house road river sky sun moon "
               "star red blue green small big fast slow is was runs sees likes eats good bad yes no").split()

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


def prepare(a, work: Path) -> None:
    """The model (random weights, local tokenizer; none when --model names a real one) and the data files, made once
    per work directory (the data once per --seq: SFT rows must be longer than it; a realistic shape's once per shape
    and tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.tiny import make_tiny_model

    shape = dict(SIZES[a.size])
    vocab = shape.pop("vocab")
    generated = work / "model"
    if a.model is None and not (generated / "config.json").exists():
        make_tiny_model(generated, max_position_embeddings=max(1024, 2 * a.seq), **shape)
        if vocab is not None:  # real vocabulary size: the logits cost what they cost on the real model
            config = AutoConfig.from_pretrained(generated)
            config.vocab_size = vocab
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(generated)
    rng = random.Random(0)
    say = lambda n: " ".join(rng.choice(VOCAB_WORDS) for _ in range(n))  # noqa: E731
    if a.shape == "realistic":  # sized in the model's tokens; the other algorithms' files are not needed
        path = data_file(a, work)
        if not path.exists():
            rows = realistic_rows(a.algo, AutoTokenizer.from_pretrained(model_dir(a, work)), say, a)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    files = {
        "sft": [{"prompt": say(16), "completion": say(2 * a.seq)} for _ in range(2000)],
        "dpo": [{"prompt": say(a.seq // 8), "chosen": say(a.seq // 3), "rejected": say(a.seq // 3)}
                for _ in range(2000)],
        "grpo": grpo_rows(say, a.prompt),
        "distill": [{"messages": [{"role": "user", "content": say(16)},  # short enough for TRL's GKD collator
                                  {"role": "assistant", "content": say(a.seq // 4)}]} for _ in range(2000)],
    }
    for name, rows in files.items():
        path = data_file(a, work, name)
        if not path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def data_file(a, work: Path, algo: str | None = None) -> Path:
    """The data file of `algo` (default --algo) at the run's --seq / --prompt / --shape."""
    algo = algo or a.algo
    if a.shape == "realistic":
        size = a.seq if algo == "dpo" else a.prompt
        return work / f"{algo}-realistic-{size}-{Path(a.model or a.size).name}.jsonl"
    if algo == "grpo" and a.prompt != 12:
        return work / f"grpo-prompt{a.prompt}.jsonl"
    return work / f"{algo}-{a.seq}.jsonl"


def model_dir(a, work: Path) -> Path:
    """The trained model: --model (smollm2: bench/real_model.py's directory), else the one prepare() generated."""
    if a.model == "smollm2":
        from real_model import smollm2_dir

        return smollm2_dir()
    return Path(a.model).expanduser() if a.model else work / "model"


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
