"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at scale",
eq. 13): completions that run into the last `buffer` tokens before the length cap lose reward linearly, so the policy
learns to stop before the cap instead of being cut off there.

    rewards:
      - name: exact_match
      - name: overlong
        kwargs: {max_length: 512, buffer: 128, penalty_factor: 1.0}   # max_length = generation.max_completion_length

With L_max = max_length, L_cache = buffer and |y| the completion's length in tokens:

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                = -1                                  if |y| > L_max

times `penalty_factor` (verl's overlong_penalty_factor; the paper's is 1). The length is the number of completion
tokens the engine returned (`completion_ids`), the quantity the cap bounds.
"""

from __future__ import annotations

import numbers
from typing import Optional

from posttrain.errors import UserError


def overlong_penalty(length: int, max_length: int, buffer: int, penalty_factor: float = 1.0) -> float:
    """R_length of one completion of `length` tokens (DAPO eq. 13), scaled by penalty_factor."""
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return penalty_factor * (expected - length) / buffer
    return -penalty_factor


class Overlong:
    """The `overlong` built-in: one R_length per completion, from its token ids (TRL's reward contract)."""

    def __init__(self, max_length: int, buffer: int, penalty_factor: float = 1.0):
        integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (max_length, buffer))
        if not (integers and 0 < buffer <= max_length):
            raise UserError("reward overlong: need integers 0 < kwargs.buffer <= kwargs.max_length (tokens; max_length "
                            f"is usually generation.max_completion_length), got buffer={buffer!r}, "
                            f"max_length={max_length!r}")
        if not (isinstance(penalty_factor, numbers.Real) and not isinstance(penalty_factor, bool)
                and penalty_factor >= 0):
            raise UserError(f"reward overlong: kwargs.penalty_factor must be a number >= 0, got {penalty_factor!r}")
        self.max_length, self.buffer, self.penalty_factor = max_length, buffer, float(penalty_factor)

    def __call__(self, prompts, completions, completion_ids: Optional[list] = None, **kwargs) -> list[float]:
        if completion_ids is None:
            raise UserError("reward overlong counts completion tokens and was called without completion_ids; it "
                            "scores online completions only")
        return [overlong_penalty(len(ids), self.max_length, self.buffer, self.penalty_factor) for ids in completion_ids]
