"""Generation engines behind one interface (see `posttrain.rollout.base`): HF generate, vLLM in-process, vLLM servers
(`posttrain serve`, `posttrain.rollout.server`)."""

from posttrain.rollout.base import Completions, GenerationEngine, SamplingParams
from posttrain.rollout.engines import make_engine
from posttrain.rollout.hf import HFEngine

__all__ = ["Completions", "GenerationEngine", "HFEngine", "SamplingParams", "make_engine"]
