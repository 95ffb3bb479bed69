"""math-verify rewards: `math_accuracy` (TRL's and open-r1's accuracy reward) and `think_answer_format` (the format
reward open-r1 pairs with it).

    rewards:
      - name: math_accuracy                # 1.0 when the completion's answer equals the `solution` column's
        kwargs: {answer_column: solution, parsing_timeout: 5}
      - name: think_answer_format          # 1.0 for '<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>'
        weight: 0.2

math_accuracy scores as TRL's `trl.rewards.accuracy_reward` does (the same math-verify calls and settings): the
reference is parsed with math-verify's defaults; a reference it cannot parse gives None (the sample is not scored);
the completion is parsed as LaTeX with \\boxed{} tried first and no answer taken without an anchor; the two are
compared by math-verify's `verify`.

Why a process of its own: math-verify bounds its parsing and comparison with signal.alarm, which works only in a
process's main thread, and posttrain calls reward functions from threads (rewards/combine.py), where TRL runs them
with no deadline at all. So the checks run in one spawned worker process, in its main thread, with math-verify's
own deadlines (parsing_timeout, verify_timeout: a hostile '\\boxed{9^{9^{9^{9}}}}' scores 0.0 after verify_timeout
seconds, as in TRL's main thread); and the worker is killed and restarted when one sample outlives both (an
operation the alarm cannot interrupt), the sample scoring 0.0 with a warning that names it. Needs the `envs` extra
(pip install 'posttrain[envs]').
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import threading
from typing import Any, Optional

from posttrain.errors import UserError, require_package
from posttrain.rewards.contract import column_values, completion_text

logger = logging.getLogger(__name__)


def require_math_verify(what: str):
    return require_package("math_verify", what, "math-verify")


def check_math(gold: str, text: str, parsing_timeout: Optional[int], verify_timeout: Optional[int]) -> Optional[float]:
    """1.0 / 0.0 whether `text`'s answer equals `gold`'s, None when `gold` does not parse (TRL's accuracy_reward on
    one sample); timeouts are math-verify's (None: none, for a thread)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    reference = parse(gold, parsing_timeout=parsing_timeout)
    if not reference:
        return None
    boxed_first = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                        try_extract_without_anchor=False)
    answer = parse(text, extraction_config=[boxed_first], extraction_mode="first_match",
                   parsing_timeout=parsing_timeout)
    return float(verify(reference, answer, timeout_seconds=verify_timeout))


def _serve(conn, parsing_timeout: int, verify_timeout: int) -> None:
    """The worker: (gold, text) in, ("ok", value) or ("error", message) out, until the pipe closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "Timeout during comparison" lines: we count them
    import math_verify  # noqa: F401 - imported (with sympy) before the first deadline starts

    conn.send(("ready", None))
    while True:
        try:
            gold, text = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", check_math(gold, text, parsing_timeout, verify_timeout)))
        except Exception as e:  # noqa: BLE001 - math-verify swallows its own; anything else is reported per sample
            conn.send(("error", f"{type(e).__name__}: {e}"))


class MathChecker:
    """A spawned worker running `check_math` in its main thread, with a hard deadline per sample on top of
    math-verify's own (see the module docstring)."""

    def __init__(self, parsing_timeout: int, verify_timeout: int, deadline: float, target=_serve):
        self.timeouts = (parsing_timeout, verify_timeout)
        self.deadline, self.target = deadline, target
        self.process, self.conn = None, None
        self.killed = 0
        self._lock = threading.Lock()

    STARTUP = 180.0
    """Seconds a fresh worker may take to import math-verify and sympy."""

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's threads
        self.conn, child = context.Pipe()
        self.process = context.Process(target=self.target, args=(child, *self.timeouts), daemon=True,
                                       name="posttrain-math-verify")
        self.process.start()
        child.close()
        if not self.conn.poll(self.STARTUP):
            self._stop()
            raise RuntimeError(f"the math-verify worker did not start within {self.STARTUP:g}s")
        self.conn.recv()

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(5)
            self.conn.close()
        self.process, self.conn = None, None

    def check(self, gold: str, text: str) -> tuple[Optional[float], Optional[str]]:
        """(value, None), or (0.0, why) when the sample overran the deadline or the worker failed on it."""
        with self._lock:
            if self.process is None or not self.process.is_alive():
                self._start()
            deadline = self.deadline
            self.conn.send((gold, text))
            if not self.conn.poll(deadline):
                self._stop()
                self.killed += 1
                return 0.0, f"no answer within {deadline:g}s (the worker was restarted)"
            try:
                status, value = self.conn.recv()
            except EOFError:  # the worker died on it
                self._stop()
                return 0.0, "the math-verify worker died on it"
            return (value, None) if status == "ok" else (0.0, value)

    def close(self) -> None:
        with self._lock:
            self._stop()


class MathAccuracy:
    """The `math_accuracy` built-in (see the module docstring): one float (or None) per completion."""

    __name__ = "math_accuracy"

    def __init__(self, answer_column: str = "solution", parsing_timeout: int = 5, verify_timeout: int = 5):
        require_math_verify("reward math_accuracy")
        for name, value in (("parsing_timeout", parsing_timeout), ("verify_timeout", verify_timeout)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"reward math_accuracy: kwargs.{name} must be a whole number of seconds >= 1 "
                                f"(math-verify's signal.alarm takes whole seconds), got {value!r}")
        self.answer_column = answer_column
        # math-verify parses the reference and the completion, then compares: past all three, the worker is stuck
        self.checker = MathChecker(parsing_timeout, verify_timeout, 2 * parsing_timeout + verify_timeout + 2.0)

    def __call__(self, completions: list, **kwargs) -> list[Optional[float]]:
        references = column_values(kwargs, self.answer_column, "math_accuracy")
        out = []
        for i, (completion, gold) in enumerate(zip(completions, references)):
            if gold is None:
                out.append(None)
                continue
            text = completion_text(completion)
            value, why = self.checker.check(str(gold), text)
            if why is not None:
                logger.warning("reward math_accuracy scores sample %d 0.0: %s (completion: %r, reference: %r)", i, why,
                               text[:120], str(gold)[:80])
            out.append(value)
        return out


_THINK_ANSWER = re.compile(r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)


def think_answer_format(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion opens with '<think>\\n', closes its thinking with '\\n</think>\\n', then gives
    '<answer>\\n...\\n</answer>' ending a line (open-r1's format reward: its pattern, matched from the start with
    re.DOTALL | re.MULTILINE, so text may follow on later lines), else 0.0."""
    return [float(_THINK_ANSWER.match(completion_text(c)) is not None) for c in completions]
