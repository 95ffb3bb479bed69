"""Pure objectives: sft, preference (DPO family, Bradley-Terry), policy (clipped surrogate, KL, aggregation)."""
