"""pass@k (Chen et al. 2021) against binomials worked out by hand and the paper's product form."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.ops.pass_at_k import pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 0.5),             # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (16, 2, 4, 0.45),           # 1 - C(14,4)/C(16,4) = 1 - 1001/1820
    (16, 0, 4, 0.0),            # no correct sample
    (16, 13, 4, 1.0),           # n - c = 3 < k: every 4 samples hold a correct one
    (10, 3, 1, 0.3),            # pass@1 is c / n
    (5, 5, 5, 1.0),
    (1000, 1, 500, 0.5),        # 1 - C(999,500)/C(1000,500) = 1 - 500/1000; C(1000,500) overflows a float
])
def test_hand_numbers(n, c, k, expected):
    got = pass_at_k(torch.tensor([n]), torch.tensor([c]), k)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_equals_the_papers_product_form_over_a_grid():
    ns, cs = zip(*[(n, c) for n in range(1, 40) for c in range(n + 1)])
    for k in (1, 2, 4, 16):
        keep = [i for i, n in enumerate(ns) if n >= k]
        n_P, c_P = torch.tensor([ns[i] for i in keep]), torch.tensor([cs[i] for i in keep])
        product = [1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
                   for n, c in zip(n_P.tolist(), c_P.tolist())]
        torch.testing.assert_close(pass_at_k(n_P, c_P, k), torch.tensor(product, dtype=torch.float64),
                                   atol=1e-12, rtol=0)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (4, 5, 2), (4, 1, 0), (4, -1, 1)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(ValueError, match=f"pass@{k} needs"):
        pass_at_k(torch.tensor([n]), torch.tensor([c]), k)
