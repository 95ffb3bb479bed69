"""posttrain: post-training for language models (SFT, reward models, DPO family, GRPO) on one recipe, any scale.

    posttrain make-tiny-model --out tiny/
    posttrain sft --config recipes/sft.yaml model.name_or_path=tiny/
    posttrain demo
"""

__version__ = "0.1.0"
