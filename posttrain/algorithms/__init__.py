"""The algorithm table: CLI command -> (its algo config dataclass, the algorithm class).

An algorithm class subclasses `posttrain.algorithms.base.Algorithm` (the whole contract, documented there and in
docs/algorithms.md) and takes the Recipe.
"""

from posttrain.algorithms.distill import Distill, DistillAlgoConfig
from posttrain.algorithms.dpo import DPO, DPOAlgoConfig
from posttrain.algorithms.grpo import GRPO, GRPOAlgoConfig
from posttrain.algorithms.ppo import PPO, PPOAlgoConfig
from posttrain.algorithms.rm import RM, RMAlgoConfig
from posttrain.algorithms.sft import SFT
from posttrain.config.schema import SFTAlgoConfig

ALGORITHMS: dict[str, tuple[type, type]] = {
    "sft": (SFTAlgoConfig, SFT),
    "grpo": (GRPOAlgoConfig, GRPO),
    "rm": (RMAlgoConfig, RM),
    "dpo": (DPOAlgoConfig, DPO),
    "ppo": (PPOAlgoConfig, PPO),
    "distill": (DistillAlgoConfig, Distill),
}


def register(name: str, config_cls: type, algorithm_cls: type) -> None:
    ALGORITHMS[name] = (config_cls, algorithm_cls)
