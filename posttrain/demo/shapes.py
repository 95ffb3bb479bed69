"""A tiny image set for the vision recipes: coloured shapes, with questions about their colour, kind and count.

    python -m posttrain.demo.shapes examples/data/shapes      # what is shipped (seeded: the same files every time)

Writes `images/NN.png` (56 x 56 pixels: 4 image tokens for the tiny Qwen2-VL) and, in TRL's formats with an `images`
column of paths relative to the data file, `sft_{train,eval}.jsonl` (messages), `dpo_train.jsonl` (prompt, chosen,
rejected: the right answer against a wrong one) and `grpo_{train,eval}.jsonl` (prompt, answer: for an exact-match
reward). The eval rows have images of their own.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (230, 210, 30)}
KINDS = ("circle", "square", "triangle")
SIZE = 56
QUESTIONS = (("colour", "What colour are the shapes? Answer with one word."),
             ("kind", "What kind of shape is shown? Answer with one word."),
             ("count", "How many shapes are there? Answer with a number."))


def draw(kind: str, colour: str, count: int):
    """A white SIZE x SIZE image with `count` shapes of one kind and colour side by side."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    width = SIZE // count
    for k in range(count):
        x0, y0, x1, y1 = k * width + 3, SIZE // 2 - width // 2 + 3, (k + 1) * width - 3, SIZE // 2 + width // 2 - 3
        fill = COLOURS[colour]
        if kind == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=fill)
        elif kind == "square":
            pen.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            pen.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
    return image


def write_shapes(out_dir, images: int = 24, eval_images: int = 8, seed: int = 0) -> Path:
    """Write the image set and its data files under out_dir (see the module docstring)."""
    rng = random.Random(seed)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    sft, dpo, grpo = [], [], []
    for n in range(images + eval_images):
        kind, colour, count = rng.choice(KINDS), rng.choice(sorted(COLOURS)), rng.randint(1, 3)
        name = f"images/{n:02d}.png"
        draw(kind, colour, count).save(out / name, optimize=True)
        facts = {"colour": colour, "kind": kind, "count": str(count)}
        wrong = {"colour": sorted(set(COLOURS) - {colour}), "kind": sorted(set(KINDS) - {kind}),
                 "count": [str(c) for c in (1, 2, 3) if c != count]}
        topic, question = QUESTIONS[n % len(QUESTIONS)]
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]

        def said(text: str) -> list[dict]:
            return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

        sft.append({"messages": user + said(facts[topic]), "images": [name]})
        dpo.append({"prompt": user, "chosen": said(facts[topic]), "rejected": said(rng.choice(wrong[topic])),
                    "images": [name]})
        grpo.append({"prompt": user, "answer": facts[topic], "images": [name]})
    files = {"sft_train": sft[:images], "sft_eval": sft[images:], "dpo_train": dpo[:images],
             "grpo_train": grpo[:images], "grpo_eval": grpo[images:]}
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


if __name__ == "__main__":
    print(f"wrote {write_shapes(sys.argv[1] if len(sys.argv) > 1 else 'examples/data/shapes')}")
