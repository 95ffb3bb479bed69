"""Generation engines behind one interface (see `posttrain.generation.base`): HF generate, vLLM in-process, vLLM servers
(`posttrain serve`, `posttrain.generation.server`)."""

from posttrain.generation.base import Completions, GenerationEngine, SamplingParams
from posttrain.generation.engines import make_engine
from posttrain.generation.hf import HFEngine

__all__ = ["Completions", "GenerationEngine", "HFEngine", "SamplingParams", "make_engine"]
