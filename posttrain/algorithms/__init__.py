"""The algorithm table: CLI command -> (its algo config dataclass, the algorithm class).

An algorithm class takes the Recipe and provides: name, data_kind ('sft' | 'preference' | 'prompt'), model_kind
('causal_lm' | 'seq_cls'), needs_reference, prepare, count, loss (see algorithms/base.py). Optional hooks:
`setup(run)` (after models are prepared, e.g. to precompute reference log-probs) and `make_source(run)` (online
algorithms build their rollout source).
"""

from posttrain.algorithms.dpo import DPO, DPOAlgoConfig
from posttrain.algorithms.grpo import GRPO, GRPOAlgoConfig
from posttrain.algorithms.rm import RM, RMAlgoConfig
from posttrain.algorithms.sft import SFT
from posttrain.config.schema import SFTAlgoConfig

ALGORITHMS: dict[str, tuple[type, type]] = {
    "sft": (SFTAlgoConfig, SFT),
    "grpo": (GRPOAlgoConfig, GRPO),
    "rm": (RMAlgoConfig, RM),
    "dpo": (DPOAlgoConfig, DPO),
}


def register(name: str, config_cls: type, algorithm_cls: type) -> None:
    ALGORITHMS[name] = (config_cls, algorithm_cls)
