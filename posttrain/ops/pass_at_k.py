"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating large language models trained on code", eq. 1).

    pass_at_k(torch.tensor([16, 16]), torch.tensor([2, 0]), 4)    # per prompt: [0.45, 0.0]

With n samples of a prompt of which c are correct, the chance that k samples drawn without replacement from the n
contain a correct one is 1 - C(n-c, k) / C(n, k); its mean over prompts estimates pass@k without the low bias of
"any of the first k" (best@k) and with less variance. The ratio of binomials is taken through log-gamma in float64,
so n in the thousands neither overflows nor cancels (the paper's own code uses the product form
prod_{i=n-c+1}^{n} (1 - k/i); the two agree, see tests/unit/test_ops_pass_at_k.py).
"""

from __future__ import annotations

import torch


def pass_at_k(num_samples_P: torch.Tensor, num_correct_P: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k of each of P prompts from its n samples and c correct ones (needs n >= k). float64, shape P."""
    n_P, c_P = num_samples_P.double(), num_correct_P.double()
    if k < 1 or bool((n_P < k).any()) or bool((c_P < 0).any()) or bool((c_P > n_P).any()):
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n for every prompt; got n={n_P.tolist()}, "
                         f"c={c_P.tolist()}")
    wrong_P = n_P - c_P
    some_pass_P = wrong_P < k  # every k-subset holds a correct sample
    safe_P = torch.where(some_pass_P, torch.full_like(wrong_P, float(k)), wrong_P)
    # log C(n-c, k) - log C(n, k) = lgamma(n-c+1) - lgamma(n-c-k+1) - lgamma(n+1) + lgamma(n-k+1)
    log_ratio_P = (torch.lgamma(safe_P + 1) - torch.lgamma(safe_P - k + 1)
                   - torch.lgamma(n_P + 1) + torch.lgamma(n_P - k + 1))
    return torch.where(some_pass_P, torch.ones_like(n_P), -torch.expm1(log_ratio_P))
