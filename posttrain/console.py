"""A clean console: the libraries' warnings that a healthy run always prints, and that only alarm people, are
dropped; the same warnings stay whenever they say something.

    from posttrain.console import quiet_healthy_run_warnings
    quiet_healthy_run_warnings()        # once per process, before the libraries log (cli.py does it)

Dropped, each by its own filter (a table, so a new one is one line):
- DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." on every import on a machine without CUDA (the run's
  own first line says device=cpu);
- accelerate's "Removed shared tensor {'lm_head.weight'} while saving" for tied embeddings (a tied model saves the
  tensor once, on purpose, and reloads it tied);
- transformers' "LOAD REPORT ... score.weight | MISSING" where the only missing weights are a value / reward head
  (`score.*`) that a reward model or critic starts afresh from a causal LM, by design;
- vLLM's "ParallelLMHead: Failed to load weights" and "RotaryEmbedding: Failed to load weights" on every weight
  sync into an engine: a tied output layer gets its weights with the embedding's (the sync sends a tied weight
  once, under the embedding's name) and rotary embeddings hold computed buffers, not weights. Any other layer that
  fails to load is still said.
"""

from __future__ import annotations

import logging
import os
import re
import sys

TIED = ("lm_head.weight", "embed_tokens.weight", "wte.weight", "embed_out.weight")


def _tied_embeddings(record: logging.LogRecord) -> bool:
    match = re.search(r"Removed shared tensor \{([^}]*)\}", record.getMessage())
    names = [n.strip(" '\"") for n in match.group(1).split(",")] if match else []
    return bool(names) and all(n.endswith(TIED) for n in names)


def _fresh_score_head(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "LOAD REPORT" not in message:
        return False
    rows = [[c.strip() for c in line.split("|")] for line in message.splitlines() if line.count("|") >= 2]
    statuses = [(row[0], row[1]) for row in rows if len(row) >= 2 and row[1] not in ("Status", "")
                and not set(row[0]) <= {"-"}]
    return bool(statuses) and all(key.startswith("score.") and status == "MISSING" for key, status in statuses)


def _tied_head_or_rotary_reload(record: logging.LogRecord) -> bool:
    match = re.fullmatch(r"(\w+): Failed to load weights", record.getMessage())
    return bool(match) and (match.group(1) == "ParallelLMHead" or match.group(1).endswith("RotaryEmbedding"))


# logger name -> the records of it to drop
NOISE = {
    "DeepSpeed": lambda record: "Setting accelerator to CPU" in record.getMessage(),
    "accelerate.utils.other": _tied_embeddings,
    "transformers.modeling_utils": _fresh_score_head,
    "vllm.model_executor.model_loader.reload.layerwise": _tied_head_or_rotary_reload,
}


class _Drop(logging.Filter):
    def __init__(self, is_noise):
        super().__init__()
        self.is_noise = is_noise

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.is_noise(record)
        except Exception:  # a message of another shape: keep it
            return True


def quiet_healthy_run_warnings() -> None:
    """Install the filters (loggers exist before their libraries import them, so this imports nothing)."""
    for name, is_noise in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(is_noise))


def no_library_bars_without_a_terminal() -> None:
    """Where stderr is no terminal (a log file, CI, nohup), the libraries' progress bars (loading weights, writing
    shards, datasets' map) are redrawn with carriage returns that pile up into long lines; posttrain's own progress is
    one line per logging step there. Set before the libraries are imported (cli.py does it first); a user's own
    setting of these variables wins."""
    if sys.stderr is not None and sys.stderr.isatty():
        return
    for variable in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):  # transformers: the hub's
        os.environ.setdefault(variable, "1")
