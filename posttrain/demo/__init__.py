"""The demos: the whole pipeline on a laptop CPU with a tiny model and synthetic tasks, no downloads.

    arithmetic.py  `posttrain demo`: SFT -> DPO -> GRPO and PPO on adding numbers (the task: posttrain/demo/tasks.py)
    tools.py       `python -m posttrain.demo.tools`: does a model that calls a calculator learn more than without one?
"""

from posttrain.demo.arithmetic import FULL, QUICK, held_out_accuracy, online_overrides, run_demo, stage

__all__ = ["FULL", "QUICK", "held_out_accuracy", "online_overrides", "run_demo", "stage"]
