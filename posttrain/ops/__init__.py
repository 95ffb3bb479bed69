"""Pure tensor functions shared by the algorithms: log-probs and masked reductions, advantages, KL estimators."""
