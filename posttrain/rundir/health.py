"""A run that trains but learns nothing, said once per sign, with the fix: read from the rows of metrics.jsonl, so
the live run and `posttrain doctor RUN_DIR` (a finished or running run) give the same diagnosis.

    health = Health()
    for finding in health.observe(row):   # MetricsLogger: each row it writes; a new sign is printed once
        print(finding.text())
    diagnose(read_metrics(run_dir))       # posttrain doctor RUN_DIR: the same checks over every row

The signs (CHECKS; TRL #3452, #3120 and ms-swift #5571, #4950 are users meeting them unwarned): prompts not
templated for a chat model, every group's rewards equal, a reward function constant over the batch, the clipped
ratio on almost every token, a zero gradient, every completion truncated, every token masked, and an engine whose
log-probs are far from the trainer's. Signs a healthy run can show once by chance (a step whose groups all agree)
count only after PATIENCE logged rows in a row; a row without a check's metric (an eval row) leaves it as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

PATIENCE = 3
"""Logged rows in a row a chance sign must last before it is said."""
ZERO_STD_LIMIT = 0.9
CLIP_LIMIT = 0.9
MISMATCH_K3_LIMIT = 1e-2
"""nats per token: an fp32 trainer against a synced fp32 vLLM engine measures ~1e-9, a bf16 engine ~1e-3."""


def _number(row: dict, key: str) -> Optional[float]:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _at_least(key: str, limit: float, detail: Callable[[float], str]) -> Callable[[dict], dict]:
    def check(row: dict) -> dict:
        value = _number(row, key)
        return {} if value is None else {"": detail(value) if value >= limit else None}
    return check


def _equals(key: str, target: float, detail: str) -> Callable[[dict], dict]:
    def check(row: dict) -> dict:
        value = _number(row, key)
        return {} if value is None else {"": detail if value == target else None}
    return check


def _constant_rewards(row: dict) -> dict:
    """rewards/<name>/std of 0: one subject per reward function."""
    out = {}
    for key in row:
        if key.startswith("rewards/") and key.endswith("/std") and (std := _number(row, key)) is not None:
            name = key[len("rewards/"):-len("/std")]
            mean = _number(row, f"rewards/{name}/mean")
            out[name] = (f"reward function {name} gave every completion the same value ({mean:.4g})"
                         if std == 0 and mean is not None else None)
    return out


@dataclass(frozen=True)
class Check:
    name: str
    signs: Callable[[dict], dict]
    """row -> {subject: what is wrong, or None where the row shows the metric healthy}; absent: not in this row."""
    fix: str
    patience: int = 1


CHECKS: tuple[Check, ...] = (
    Check("untemplated_prompts", _at_least(
        "prompts/untemplated_fraction", 1e-12, lambda v: f"{v:.0%} of the prompts are plain text while the tokenizer "
        "has a chat template, so the model reads them without its chat format"),
        "write them as conversational rows ({\"prompt\": [{\"role\": \"user\", \"content\": ...}]}, TRL's "
        "conversational format), which are rendered with the chat template"),
    Check("reward_zero_std", _at_least(
        "frac_reward_zero_std", ZERO_STD_LIMIT, lambda v: f"frac_reward_zero_std={v:.2f}: in that share of the prompt "
        "groups every completion got the same reward, so their advantages are 0 and they teach nothing"),
        "make the reward denser (partial credit) or the prompts fit the model's level, raise algo.num_generations "
        "or generation.temperature, or drop such groups with algo.dynamic_sampling.enabled=true", PATIENCE),
    Check("constant_reward", _constant_rewards,
          "check that the function reads the completions as passed (strings, or message lists for conversational "
          "data) and the dataset columns it needs; a constant reward only shifts the total", PATIENCE),
    Check("clip_fraction", _at_least(
        "clip_fraction", CLIP_LIMIT, lambda v: f"clip_fraction={v:.2f}: the ratio pi / pi_old is outside the clip "
        "range on almost every token, which then gets no gradient"),
        "lower train.learning_rate or algo.num_iterations (PPO: algo.ppo_epochs); with an engine apart see "
        "mismatch/phantom_clip_fraction"),
    Check("zero_grad_norm", _equals("grad_norm", 0.0, "the gradient norm is 0: no weight moved"),
          "every advantage was 0 (see frac_reward_zero_std), every token was masked, or nothing trains (LoRA "
          "target_modules)", PATIENCE),
    Check("all_truncated", _equals(
        "truncated_fraction", 1.0, "every completion reached generation.max_completion_length without an end of "
        "sequence"),
        "raise generation.max_completion_length, or check that the model can stop: the tokenizer's eos token and "
        "the chat template's end of turn (posttrain checks generation_config's eos_token_id)", PATIENCE),
    Check("all_masked", _equals("trained_tokens", 0.0, "every completion token was masked out of the loss: "
                                "nothing trained"),
          "algo.mask_truncated_completions=true leaves truncated completions out (see truncated_fraction); for SFT, "
          "rows whose assistant / completion part is empty or cut off by data.max_length train nothing"),
    Check("engine_mismatch", _at_least(
        "mismatch/k3", MISMATCH_K3_LIMIT, lambda v: f"mismatch/k3={v:.3g}: the engine's log-probs of its own tokens "
        "are far from the trainer's"),
        "sync every step (generation.sync_every=1), load both sides in one dtype, lower generation.max_staleness, "
        "or correct for it with algo.vllm_is_correction=true (token_mask or icepop leave the worst tokens out)"),
)


@dataclass(frozen=True)
class Finding:
    check: str
    subject: str
    step: int
    detail: str
    fix: str

    def text(self) -> str:
        return f"step {self.step}: {self.detail}. Fix: {self.fix}"


class Health:
    """The checks over a run's rows as they come: each sign is found once (per check and subject)."""

    def __init__(self, checks: tuple[Check, ...] = CHECKS):
        self.checks = checks
        self.streaks: dict[tuple[str, str], int] = {}
        self.found: set[tuple[str, str]] = set()

    def observe(self, row: dict) -> list[Finding]:
        """The signs this row completes (said for the first time)."""
        new = []
        for check in self.checks:
            for subject, detail in check.signs(row).items():
                key = (check.name, subject)
                self.streaks[key] = self.streaks.get(key, 0) + 1 if detail else 0
                if detail and self.streaks[key] >= check.patience and key not in self.found:
                    self.found.add(key)
                    new.append(Finding(check.name, subject, int(row.get("step", 0)), detail, check.fix))
        return new


def diagnose(rows: list[dict]) -> list[Finding]:
    """Every sign in a run's rows, in the order a live run would have said them."""
    health = Health()
    return [finding for row in rows for finding in health.observe(row)]
