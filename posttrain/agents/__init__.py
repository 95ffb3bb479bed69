"""Multi-turn rollouts with tools and environments, token-in / token-out, over any generation engine.

    agent:                                  # in a grpo recipe (docs/agents.md)
      tools: [my_tools:calculator]
      environment: my_envs:Game               # optional
      max_turns: 4

Layers: this package sits beside posttrain/generation/ (it drives a GenerationEngine) and below train/ (the rollout
source hands generation to it); it never imports train/ or run.py.
"""

from posttrain.agents.checks import check_agent
from posttrain.agents.environment import Environment
from posttrain.agents.loop import AgentLoop, Trajectory
from posttrain.agents.scoring import agent_metrics, score_trajectories
from posttrain.agents.tools import Tool, ToolRunner, load_tools, opening_tools

__all__ = ["AgentLoop", "Environment", "Tool", "ToolRunner", "Trajectory", "agent_metrics", "check_agent",
           "load_tools", "opening_tools", "score_trajectories"]
