"""Tokenisation, once, up front: dataset rows -> lists of token ids (+ loss masks), with counts of what was cut.

    examples, stats = tokenize_sft(rows, tokenizer, recipe.data, "data.train")        # SFT
    examples, stats = tokenize_preference(rows, tokenizer, recipe.data, "data.train") # RM, DPO family
    examples, stats = tokenize_prompts(rows, tokenizer, recipe.data, "data.train")    # GRPO, PPO

Every example's `completion_mask[0]` is 0: the first token is predicted by nothing (see posttrain.batch).
Standard (string) rows are tokenised with the tokenizer's own special tokens (BOS) and completions end with EOS;
conversational rows are rendered with the chat template, which writes its own special tokens.
Rows that leave nothing to train are dropped and counted in `stats`; if none are left, a UserError says why.
A conversational row's `tools` column (TRL's tool-calling format, posttrain/data/tools.py) is rendered by the chat
template with it; assistant tool calls are trained like the rest of their turn, `tool` messages like other
non-assistant turns.
"""

from __future__ import annotations

import os

import datasets

from posttrain.config import DataConfig
from posttrain.data.chat import (assistant_spans, check_roles, mask_from_spans, render, require_chat_template,
                                 split_rendered)
from posttrain.data.formats import DataFormat, clean_messages, detect_format
from posttrain.data.images import RowImages, image_parts
from posttrain.data.tools import check_tool_calls_rendered, check_tools_rendered, row_tools, tool_name
from posttrain.errors import UserError


def _ids(tokenizer, text: str, special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special_tokens)["input_ids"]


def _with_eos(tokenizer, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _detect(dataset, tokenizer, what: str, accepts, needs: str, images: RowImages | None = None) -> DataFormat:
    fmt = detect_format(dataset, what)
    if not accepts(fmt):
        raise UserError(f"{what}: {needs}; this dataset is {fmt.kind} data (columns {dataset.column_names})")
    if images is not None and not fmt.conversational:
        raise UserError(f"{what}: has an {images.column!r} column beside string rows; images go with conversational "
                        "rows whose contents place them with {'type': 'image'} parts (docs/vision.md)")
    if fmt.conversational:
        require_chat_template(tokenizer, what)
        check_roles(dataset.select_columns(list(fmt.columns())), fmt.columns(), tokenizer, what, images is not None)
    return fmt


def _image_stats(images: RowImages | None) -> dict:
    """The count of rows dropped because a cut to the length limit would split an image's tokens (with images)."""
    return {} if images is None else {"dropped_image_cut": 0}


def _read_columns(dataset, fmt: DataFormat, images: RowImages | None = None) -> list[str]:
    """The columns a tokenizer reads: the format's, and `tools` (and the image column) beside conversational ones."""
    extra = ["tools"] if fmt.conversational and "tools" in dataset.column_names else []
    return list(fmt.columns()) + extra + ([images.column] if images is not None else [])


class _Tools:
    """Each row's tools (its `tools` column, plus `extra` schemas for every row), with the template checked to show
    them once (on the first row that has any) and every assistant tool call checked to be rendered."""

    def __init__(self, tokenizer, extra: list[dict] | None = None):
        self.tokenizer, self.extra, self.checked = tokenizer, list(extra or []), False

    def of(self, row: dict, where: str) -> list[dict] | None:
        own = row_tools(row.get("tools"), where) or []
        named = {tool_name(t) for t in own}
        tools = own + [t for t in self.extra if tool_name(t) not in named]
        return tools or None

    def check(self, messages: list[dict], tools: list[dict] | None, where: str) -> None:
        if tools and not self.checked:
            check_tools_rendered(self.tokenizer, messages, tools, where)
            self.checked = True
        check_tool_calls_rendered(self.tokenizer, messages, tools, where)


# --- SFT --------------------------------------------------------------------------------------------------------------


def tokenize_sft(dataset: datasets.Dataset, tokenizer, data_cfg: DataConfig, what: str = "data.train",
                 images: RowImages | None = None):
    """Rows -> [{"input_ids", "completion_mask"(, "images")}], stats {rows, examples, tokens, completion_tokens,
    truncated, dropped_no_completion, dropped_empty (see _sft_empty), dropped_image_cut}. Sequences are cut to
    data_cfg.max_length, keeping their start; a row whose cut would split an image's tokens is dropped instead.
    images: the dataset's image column (data/images.py): each image's placeholder widened, out of the loss."""
    fmt = _detect(dataset, tokenizer, what, lambda f: f.kind in ("language_modeling", "prompt_completion"),
                  "SFT needs text, messages or prompt + completion rows", images)
    stats = dict(rows=len(dataset), examples=0, tokens=0, completion_tokens=0, truncated=0, dropped_no_completion=0,
                 dropped_empty=0, **_image_stats(images))
    examples = []
    tooling = _Tools(tokenizer)
    for i, row in enumerate(dataset.select_columns(_read_columns(dataset, fmt, images))):
        if _sft_empty(row, fmt):
            stats["dropped_empty"] += 1
            continue
        if images is not None:
            row = images.placed(row, ("messages",) if "messages" in row else ("prompt",))
        input_ids, mask = (_sft_conversation(row, tokenizer, data_cfg, f"{what} row {i}", tooling) if fmt.conversational
                           else _sft_text(row, tokenizer, data_cfg))
        refs = None
        if images is not None:
            messages = [m for column in ("messages", "prompt", "completion") for m in row.get(column) or []]
            refs = images.refs(row, messages, f"{what} row {i}")
            input_ids, mask = images.widen(input_ids, mask, refs)
            if refs and images.token_id in input_ids[data_cfg.max_length:]:
                stats["dropped_image_cut"] += 1
                continue
        if len(input_ids) > data_cfg.max_length:
            input_ids, mask = input_ids[: data_cfg.max_length], mask[: data_cfg.max_length]
            stats["truncated"] += 1
        mask[0] = 0
        if not any(mask):
            stats["dropped_no_completion"] += 1
            continue
        examples.append({"input_ids": input_ids, "completion_mask": mask, **({"images": refs} if images else {})})
        stats["tokens"] += len(input_ids)
        stats["completion_tokens"] += sum(mask)
    stats["examples"] = len(examples)
    if not examples:
        cut = f", {stats['dropped_image_cut']} whose images did not fit" if "dropped_image_cut" in stats else ""
        raise UserError(f"{what}: no row has a token to train on within data.max_length={data_cfg.max_length} "
                        f"({stats['rows']} rows, {stats['dropped_empty']} with an empty text, completion or assistant "
                        f"turn, {stats['truncated']} truncated{cut}); raise data.max_length or check that rows have "
                        "completions / assistant turns")
    return examples, stats


def _sft_empty(row: dict, fmt: DataFormat) -> bool:
    """A row that would train on nothing but special tokens: an empty text or completion, or an assistant turn with
    neither text nor a tool call (the template would still write its end-of-turn token, and the model would learn
    to answer with nothing)."""
    if not fmt.conversational:
        return not (row["text"] if "text" in row else row["completion"]).strip()
    trained = clean_messages(row["messages"] if "messages" in row else row["completion"])
    return _no_text(trained) or _blank_turn(trained)


def _sft_text(row: dict, tokenizer, data_cfg: DataConfig) -> tuple[list[int], list[int]]:
    if "text" in row:
        input_ids = _with_eos(tokenizer, _ids(tokenizer, row["text"], True))
        return input_ids, [1] * len(input_ids)
    prompt_ids = _ids(tokenizer, row["prompt"], True)
    completion_ids = _with_eos(tokenizer, _ids(tokenizer, row["completion"], False))
    prompt_mask = [0 if data_cfg.completion_only_loss else 1] * len(prompt_ids)
    return prompt_ids + completion_ids, prompt_mask + [1] * len(completion_ids)


def _sft_conversation(row: dict, tokenizer, data_cfg: DataConfig, where: str,
                      tooling: _Tools) -> tuple[list[int], list[int]]:
    prompt = [] if "messages" in row else clean_messages(row["prompt"])
    messages = clean_messages(row["messages"]) if "messages" in row else prompt + clean_messages(row["completion"])
    completion_only = data_cfg.completion_only_loss and bool(prompt)  # only prompt-completion rows have a prompt
    tools = tooling.of(row, where)
    tooling.check(messages, tools, where)
    full = render(tokenizer, messages, tools=tools)
    if data_cfg.assistant_only_loss:
        first = len(prompt) if completion_only else 0
        spans = assistant_spans(tokenizer, messages, full, first, where, "data.assistant_only_loss", tools)
    elif completion_only:
        prompt_text, completion_text = split_rendered(tokenizer, prompt, messages[len(prompt):], where,
                                                      "data.completion_only_loss", tools)
        spans = [(len(prompt_text), len(prompt_text) + len(completion_text))]
    else:
        spans = [(0, len(full))]
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], mask_from_spans(encoded["offset_mapping"], spans)


# --- preference pairs -------------------------------------------------------------------------------------------------


def tokenize_preference(dataset: datasets.Dataset, tokenizer, data_cfg: DataConfig, what: str = "data.train",
                        images: RowImages | None = None):
    """Rows -> [{"prompt_ids", "chosen_ids", "rejected_ids"(, "margin")}], stats {rows, pairs, tokens (of both
    sequences of each pair), truncated, dropped_prompt_mismatch, dropped_identical, dropped_empty}.
    Completions end with the end-of-turn / EOS token. Implicit prompts: the shared string prefix (standard) or the
    messages before the last assistant turn, which must be equal in chosen and rejected (conversational)."""
    fmt = _detect(dataset, tokenizer, what, lambda f: f.kind == "preference",
                  "preference training needs prompt + chosen + rejected (or chosen + rejected) rows", images)
    has_margin = "margin" in dataset.column_names
    stats = dict(rows=len(dataset), pairs=0, tokens=0, truncated=0,
                 dropped_prompt_mismatch=0, dropped_identical=0, dropped_empty=0, **_image_stats(images))
    examples = []
    tooling = _Tools(tokenizer)
    columns = _read_columns(dataset, fmt, images) + (["margin"] if has_margin else [])
    for i, row in enumerate(dataset.select_columns(columns)):
        where = f"{what} row {i}"
        if images is not None:
            row = images.placed(row, ("chosen", "rejected") if fmt.implicit_prompt else ("prompt",))
        split = _split_pair(row, fmt)
        if isinstance(split, str):
            stats[f"dropped_{split}"] += 1
            continue
        prompt, chosen, rejected = split
        if fmt.conversational:
            tools = tooling.of(row, where)
            for completion in (chosen, rejected):
                tooling.check(prompt + completion, tools, where)
            prompt_text, chosen_text = split_rendered(tokenizer, prompt, chosen, where, tools=tools)
            _, rejected_text = split_rendered(tokenizer, prompt, rejected, where, tools=tools)
            prompt_ids = _ids(tokenizer, prompt_text, False)
            chosen_ids, rejected_ids = _ids(tokenizer, chosen_text, False), _ids(tokenizer, rejected_text, False)
        else:
            prompt_ids = _ids(tokenizer, prompt, True)
            chosen_ids, rejected_ids = (_with_eos(tokenizer, _ids(tokenizer, c, False)) for c in (chosen, rejected))
        refs = None
        if images is not None:  # the prompt's images, shared by chosen and rejected
            refs, prompt_ids = _prompt_images(images, row, prompt, (chosen, rejected), prompt_ids, where)
        example, truncated = _fit_pair(prompt_ids, chosen_ids, rejected_ids, data_cfg.max_length)
        if refs and example["prompt_ids"].count(images.token_id) != sum(ref.tokens for ref in refs):
            stats["dropped_image_cut"] += 1
            continue
        if refs is not None:
            example["images"] = refs
        stats["truncated"] += truncated
        if has_margin:
            example["margin"] = _margin(row["margin"], where)
        examples.append(example)
        stats["tokens"] += 2 * len(example["prompt_ids"]) + len(example["chosen_ids"]) + len(example["rejected_ids"])
    stats["pairs"] = len(examples)
    if not examples:
        raise UserError(f"{what}: no usable preference pair in {stats['rows']} rows: "
                        f"{stats['dropped_prompt_mismatch']} had no prompt shared by chosen and rejected, "
                        f"{stats['dropped_identical']} had chosen == rejected, {stats['dropped_empty']} had an empty "
                        "chosen or rejected")
    return examples, stats


def _prompt_images(images: RowImages, row: dict, prompt: list[dict], completions, prompt_ids: list[int], where: str):
    """(the row's images, prompt_ids with their placeholders widened): images are placed by the prompt's image parts;
    a completion holding one is refused."""
    if any(image_parts(completion) for completion in completions):
        raise UserError(f"{where}: an image part in a completion; images go in the prompt (chosen and rejected, or "
                        "the generated completions, answer it)")
    refs = images.refs(row, prompt, where)
    return refs, images.widen(prompt_ids, [0] * len(prompt_ids), refs)[0]


def _margin(value, where: str) -> float:
    try:  # a number, or text from a CSV cell
        if not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise UserError(f"{where}: column 'margin' must be a number, got {value!r:.40}")


def _split_pair(row: dict, fmt: DataFormat):
    """(prompt, chosen, rejected) completions, or the reason to drop the pair: prompt_mismatch, empty, identical."""
    if fmt.conversational:
        chosen, rejected = clean_messages(row["chosen"]), clean_messages(row["rejected"])
        if fmt.implicit_prompt:
            cut_c, cut_r = _last_assistant(chosen), _last_assistant(rejected)
            if cut_c is None or cut_r is None:
                return "empty"
            if cut_c == 0 or chosen[:cut_c] != rejected[:cut_r]:
                return "prompt_mismatch"
            prompt, chosen, rejected = chosen[:cut_c], chosen[cut_c:], rejected[cut_r:]
        else:
            prompt = clean_messages(row["prompt"])
        empty = any(_no_text(m) or _blank_turn(m) for m in (chosen, rejected))
    else:
        prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
        if fmt.implicit_prompt:
            prompt, chosen, rejected = _shared_prefix(chosen, rejected)
            if not prompt:
                return "prompt_mismatch"
        empty = not chosen.strip() or not rejected.strip()
    return "identical" if chosen == rejected else "empty" if empty else (prompt, chosen, rejected)


def _no_text(messages: list[dict]) -> bool:
    """No message, or only blank string contents (a tool call's None content is not blank)."""
    return all(isinstance(m.get("content"), str) and not m["content"].strip() for m in messages)


def _blank_turn(messages: list[dict]) -> bool:
    """An assistant message with no text (a string, or text parts) and no tool call."""
    def text(content) -> str:
        if isinstance(content, list):
            return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else ""

    return any(m.get("role") == "assistant" and not m.get("tool_calls") and not text(m.get("content")).strip()
               for m in messages)


def _last_assistant(messages: list[dict]):
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)


def _shared_prefix(chosen: str, rejected: str) -> tuple[str, str, str]:
    """TRL's implicit prompt: the longest common prefix, leaving a space that ends it to the completions."""
    n = len(os.path.commonprefix([chosen, rejected]))
    if n < min(len(chosen), len(rejected)) and n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _fit_pair(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int):
    """Cut so that prompt + completion <= max_length for both: keep the prompt's last tokens (down to half the
    budget at least), then the completions' first tokens. Returns (example, 1 if anything was cut else 0)."""
    longest = max(len(chosen_ids), len(rejected_ids))
    if len(prompt_ids) + longest <= max_length:
        return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}, 0
    keep = min(len(prompt_ids), max(max_length - longest, max_length // 2))
    room = max_length - keep
    prompt_ids = prompt_ids[len(prompt_ids) - keep:]
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids[:room], "rejected_ids": rejected_ids[:room]}, 1


# --- prompts for generation -------------------------------------------------------------------------------------------


def tokenize_prompts(dataset: datasets.Dataset, tokenizer, data_cfg: DataConfig, what: str = "data.train",
                     rollout_tools: list[dict] | None = None, images: RowImages | None = None):
    """Rows -> [{"prompt_ids", "prompt", "tools", "columns", "untemplated"(, "messages")}] (tools: the schemas
    rendered, or None; columns: the row's other values, for rewards; untemplated: plain text tokenised as it is
    for a tokenizer with a chat template; messages: the opening chat, multi-turn only); stats {rows, tokens,
    truncated, dropped_empty}. Empty prompts are dropped; long ones keep their last max_prompt_length tokens, counted
    in `truncated` (the tools turn included).
    rollout_tools: a multi-turn rollout starts from these prompts (not None; a list of the rollout's tool schemas,
    rendered beside the row's own): string prompts open a chat as one user message, and the limit is
    max_prompt_length or else max_length, the prompt posttrain/agents/loop.py continues."""
    fmt = _detect(dataset, tokenizer, what, lambda f: "prompt" in f.columns(), "generation needs a 'prompt' column",
                  images)
    multi_turn = rollout_tools is not None
    limit = data_cfg.max_prompt_length or (data_cfg.max_length if multi_turn else None)
    stats = dict(rows=len(dataset), tokens=0, truncated=0, dropped_empty=0, **_image_stats(images))
    examples = []
    tooling = _Tools(tokenizer, rollout_tools)
    chat_model = getattr(tokenizer, "chat_template", None) is not None  # plain text then skips its chat format
    for i, row in enumerate(dataset):
        row = images.placed(row, ("prompt",)) if images is not None else row
        prompt = clean_messages(row["prompt"]) if fmt.conversational else row["prompt"]
        if not prompt or (_no_text(prompt) if fmt.conversational else not prompt.strip()):
            stats["dropped_empty"] += 1  # nothing to answer: the generation would start from nothing
            continue
        tools = None
        if fmt.conversational or multi_turn:
            messages = prompt if fmt.conversational else [{"role": "user", "content": prompt}]
            tools = tooling.of(row, f"{what} row {i}")
            tooling.check(messages, tools, f"{what} row {i}")
            prompt_ids = _ids(tokenizer, render(tokenizer, messages, add_generation_prompt=True, tools=tools), False)
        else:
            prompt_ids = _ids(tokenizer, prompt, True)
        refs = None
        if images is not None:
            refs, prompt_ids = _prompt_images(images, row, messages, (), prompt_ids, f"{what} row {i}")
        if limit is not None and len(prompt_ids) > limit:
            if refs and images.token_id in prompt_ids[:len(prompt_ids) - limit]:
                stats["dropped_image_cut"] += 1
                continue
            prompt_ids = prompt_ids[len(prompt_ids) - limit:]
            stats["truncated"] += 1
        stats["tokens"] += len(prompt_ids)
        columns = {k: v for k, v in row.items() if k != "prompt"}
        example = {"prompt_ids": prompt_ids, "prompt": prompt, "tools": tools, "columns": columns,
                   "untemplated": not (fmt.conversational or multi_turn) and chat_model,
                   **({"images": refs} if refs is not None else {})}
        examples.append({**example, "messages": messages} if multi_turn else example)
    if not examples:
        if stats.get("dropped_image_cut"):
            raise UserError(f"{what}: no prompt keeps its images within data.max_prompt_length={limit} "
                            f"({stats['dropped_image_cut']} of {stats['rows']} would be cut inside an image); raise it")
        raise UserError(f"{what}: every one of the {stats['rows']} prompts is empty; give rows with a prompt to answer")
    return examples, stats
