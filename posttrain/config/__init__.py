from posttrain.config.load import dump_yaml, load_recipe
from posttrain.config.schema import (DataConfig, GenerationConfig, LoraConfig, ModelConfig, Recipe, RewardConfig,
                                     SFTAlgoConfig, TrainConfig)

__all__ = ["DataConfig", "GenerationConfig", "LoraConfig", "ModelConfig", "Recipe", "RewardConfig", "SFTAlgoConfig",
           "TrainConfig", "dump_yaml", "load_recipe"]
