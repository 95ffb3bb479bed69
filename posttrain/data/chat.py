"""Chat templates: render conversations and find the characters a loss mask should cover, for any template.

A turn's trained text is what the model must produce after being prompted with the conversation so far plus the
generation prompt: `render(messages[:i+1])` minus `render(messages[:i], add_generation_prompt=True)`. That holds
for any template with the prefix property (rendering a prefix of a conversation gives a prefix of the string);
templates without it (ones that rewrite earlier turns, or count turns up front) are refused rather than guessed at.

Whitespace after the end-of-turn token (ChatML's "\n" after <|im_end|>) is not trained: generation stops at the
end-of-turn token, so the model never produces it. The end-of-turn token itself is trained, so the model learns to
stop.
"""

from __future__ import annotations

import re

from posttrain.errors import UserError

Span = tuple[int, int]


def require_chat_template(tokenizer, what: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{what} holds conversations (lists of messages) but the tokenizer has no chat template; "
                        "set model.chat_template to a Jinja template or a .jinja file")


STANDARD_ROLES = ("system", "user", "assistant", "tool")


def known_roles(tokenizer) -> set[str]:
    """The standard roles and any other word the template quotes ('developer', 'ipython', ...): a role outside them is
    almost always a typo, and a template renders it silently as a turn of its own (or drops it)."""
    template = tokenizer.chat_template
    text = " ".join(template.values()) if isinstance(template, dict) else str(template)
    return set(STANDARD_ROLES) | set(re.findall(r"""['"]([A-Za-z_][\w-]*)['"]""", text))


def content_problem(content, images: bool = False) -> str:
    """Why a message's content cannot be trained on, or '': a string, None (a turn of tool calls) or a list of text
    parts (the template joins them), and image parts when the dataset has images (data/images.py). An image part
    for a text model used to end in the template's TypeError."""
    if content is None or isinstance(content, str):
        return ""
    if not isinstance(content, list):
        return f"has content of type {type(content).__name__}; give a string"
    kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content]
    other = [kind for kind in kinds if kind not in (("text", "image") if images else ("text",))]
    if not other:
        return ""
    if other[0] == "image":
        return ("holds an 'image' part but the dataset has no 'images' column: give each row's images in one, for a "
                "vision-language model (docs/vision.md), or remove the image parts")
    return (f"holds a {other[0]!r} part; posttrain trains text and image parts only: remove the others, or give the "
            "content as a string")


def check_roles(rows, columns, tokenizer, what: str, images: bool = False) -> None:
    """Every message's role must be one the chat template knows, and its content text (or images, with `images`); a
    UserError names the row, column and message."""
    known = known_roles(tokenizer)
    for i, row in enumerate(rows):
        for column in columns:
            for j, message in enumerate(row[column] or []):
                problem = content_problem(message.get("content"), images)
                if problem:
                    raise UserError(f"{what} row {i}: column {column!r} message {j} {problem}")
                if message["role"] not in known:
                    raise UserError(f"{what} row {i}: column {column!r} message {j} has role {message['role']!r}, "
                                    "which the chat template does not know (roles: "
                                    f"{', '.join(sorted(STANDARD_ROLES))}); fix the row, or set model.chat_template "
                                    "to a template that handles it")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
    """tools: JSON schemas the template shows the model (None or [] renders none: Llama's template writes its tools
    boilerplate for an empty list)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _no_prefix_property(where: str, option: str | None) -> UserError:
    fix = f"set {option}=false or fix the template" if option else "fix the template"
    return UserError(f"{where}: the chat template does not render a conversation's beginning as the beginning of the "
                     "whole conversation (it rewrites or reorders earlier turns), so the trained tokens cannot be "
                     f"found; {fix} (model.chat_template)")


def split_rendered(tokenizer, prompt: list[dict], completion: list[dict], where: str,
                   option: str | None = None, tools: list[dict] | None = None) -> tuple[str, str]:
    """(prompt text with generation prompt, completion text) such that their concatenation is the rendered whole."""
    prompt_text = render(tokenizer, prompt, add_generation_prompt=True, tools=tools)
    full = render(tokenizer, prompt + completion, tools=tools)
    if not full.startswith(prompt_text):
        raise _no_prefix_property(where, option)
    return prompt_text, full[len(prompt_text):].rstrip()


def assistant_spans(tokenizer, messages: list[dict], full: str, first: int, where: str, option: str,
                    tools: list[dict] | None = None) -> list[Span]:
    """Character spans in `full` (the rendered conversation) of the assistant turns messages[first:]; one that opens
    the conversation is not trained (it answers nothing, and the empty conversation before it cannot be rendered)."""
    spans = []
    for i in range(max(first, 1), len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = render(tokenizer, messages[: i + 1], tools=tools)
        if not (through.startswith(before) and full.startswith(through)):
            raise _no_prefix_property(where, option)
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    return spans


def mask_from_spans(offsets: list[Span], spans: list[Span]) -> list[int]:
    """1 for each token whose characters overlap a span (special tokens added outside the text have empty offsets)."""
    return [int(any(lo < span_hi and hi > span_lo for span_lo, span_hi in spans)) for lo, hi in offsets]
