"""``generate``'s token choice: greedy is the first largest logit, top-p keeps the smallest set
of tokens holding that probability, and a seed gives the same draws.

Reference: the softmax computed here from the definition (Holtzman et al. 2019's nucleus), and
``torch.argmax``'s first-index tie rule (what transformers' greedy search uses)."""

from __future__ import annotations

import torch

from zerotron.model.inference import _pick


def test_greedy_takes_the_first_largest_logit():
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0]])
    assert _pick(logits, 0.0, 1.0, None).tolist() == [1]


def test_top_p_draws_only_inside_the_nucleus_and_a_seed_repeats_the_draws():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]))  # nucleus at 0.7: tokens 1 and 2
    draws = [int(_pick(logits, 1.0, 0.7, torch.Generator().manual_seed(s))) for s in range(200)]
    assert set(draws) == {1, 2}
    share = draws.count(1) / len(draws)  # 0.5 / 0.8 of the renormalised nucleus
    assert abs(share - 0.625) < 0.12, share
    again = [int(_pick(logits, 1.0, 0.7, torch.Generator().manual_seed(s))) for s in range(200)]
    assert again == draws
    everything = {int(_pick(logits, 1.0, 1.0, torch.Generator().manual_seed(s))) for s in range(400)}
    assert everything == {0, 1, 2, 3}


def test_a_low_temperature_sharpens_towards_the_argmax():
    logits = torch.log(torch.tensor([[0.2, 0.45, 0.35]]))
    draws = [int(_pick(logits, 0.05, 1.0, torch.Generator().manual_seed(s))) for s in range(100)]
    assert draws.count(1) >= 95
