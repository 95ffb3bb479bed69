"""SFT steps of the tiny Qwen2-VL on the shipped shapes images, as a row of bench/gpu_suite.py: a vision-language run
(processor, pixel tensors, 3-D rope, image tokens out of the loss) on the device the suite runs on.

    python bench/vision_step.py --work runs/vision-step --json figures.json [--steps 1]

Makes the model (posttrain make-tiny-model --arch qwen2_vl) and the data (posttrain.demo.shapes) under --work when
they are not there, runs `posttrain sft` for --steps steps of 4 rows, and writes its figures as JSON: the loss, seconds
a step (the whole command's wall time over its steps: start-up included, what a user waits), tokens / s and the
peak memory the run logged, and the device (each shapes image is 4 image tokens on the tiny model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="where the model, the data and the run go")
    p.add_argument("--json", required=True, help="the figures file")
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args(argv)
    import torch

    from posttrain.cli import main as posttrain
    from posttrain.demo.shapes import write_shapes
    from posttrain.models.tiny_vision import make_tiny_vlm

    work = Path(a.work).resolve()
    model, data, out = work / "tiny-vl", work / "shapes", work / "sft-vlm"
    if not (model / "config.json").is_file():
        make_tiny_vlm(model)
    if not (data / "sft_train.jsonl").is_file():
        write_shapes(data)
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    code = posttrain(["sft", f"model.name_or_path={model}", f"data.train={data / 'sft_train.jsonl'}",
                      f"output_dir={out}", f"train.max_steps={a.steps}", "train.per_device_train_batch_size=4",
                      "train.logging_steps=1", "train.report=false", "train.tensorboard=false"])
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    last = rows[-1] if rows else {}
    figures = {"exit": code, "steps": len(rows), "loss": last.get("loss"), "s/step": seconds / max(1, len(rows)),
               "tokens/s": last.get("tokens_per_second"), "peak_memory_mb": last.get("peak_memory_mb"),
               "device": "cuda" if torch.cuda.is_available() else "cpu"}
    Path(a.json).write_text(json.dumps(figures, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
