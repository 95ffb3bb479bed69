"""The online machinery: what an online algorithm (GRPO family, PPO, distillation) needs beyond the shared loop.

    rollout_source.RolloutSource    prompts -> engines -> scores -> the step's Batch (a "rollout" is this online batch)
    engine_link.EngineLink          the trainer's one link to its generation engines: sync, versions, seeded sampling
    in_flight.InFlight              batches sampled ahead (generation.max_staleness), carried by checkpoints
    dynamic_sampling.DynamicSampler DAPO's redraws of groups whose rewards do not vary
    scoring.score                   the RewardSet on completions (single-turn) or trajectories (agents)
    distill_source.DistillSource    on-policy distillation: the student's samples, no rewards
    evaluation                      held-out accuracy, reward and pass@k of a sampled run

train/ holds the loop every algorithm shares; nothing in train/ imports this package.
"""
