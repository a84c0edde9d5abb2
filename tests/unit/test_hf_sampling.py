"""The hf engine's per-row seeded sampler: exact odds, the nucleus, and rows independent of the batch."""

import math

import torch
from rlver_plugins.hf_engine.engine import _SeededRowSampler

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def sample(logits: torch.Tensor, seeds: list[int], temperature: float = 1.0, top_p: float = 1.0) -> list[int]:
    sampler = _SeededRowSampler(seeds, temperature, top_p, torch.device("cpu"))
    scores = sampler(torch.zeros((len(seeds), 1), dtype=torch.long), logits)
    assert ((scores == 0).sum(-1) == 1).all() and torch.isinf(scores).sum() == scores.numel() - len(seeds)
    return scores.argmax(-1).tolist()


def test_each_token_is_drawn_at_its_softmax_odds():
    rows = 6000
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.6)):
        chosen = sample(LOGITS.repeat(rows, 1), list(range(rows)), temperature, top_p)
        odds = torch.softmax(LOGITS / temperature, -1)
        odds = odds.masked_fill(odds.cumsum(-1) - odds >= top_p, 0.0)  # the nucleus, renormalised
        odds = (odds / odds.sum()).tolist()
        for token, p in enumerate(odds):
            frequency = chosen.count(token) / rows
            assert abs(frequency - p) < 4.5 * math.sqrt(p * (1 - p) / rows) + 1e-9, (
                temperature,
                top_p,
                token,
            )


def test_tokens_outside_the_nucleus_are_never_drawn_and_masked_ones_never():
    logits = LOGITS.clone()
    logits[-2:] = float("-inf")  # e.g. banned tokens at the end of the vocabulary
    odds = torch.softmax(LOGITS, -1)
    nucleus = int((odds.cumsum(-1) - odds < 0.8).sum())  # tokens whose mass before them is < top_p
    chosen = sample(logits.repeat(3000, 1), list(range(3000)), top_p=0.8)
    assert set(chosen) == set(range(nucleus))
    chosen = sample(logits.repeat(3000, 1), list(range(3000)))
    assert set(chosen) == {0, 1, 2, 3}


def test_a_rows_draw_depends_on_its_seed_only():
    batch = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.3, LOGITS])
    together = sample(batch, [11, 12, 13, 14])
    alone = [sample(batch[i : i + 1], [seed])[0] for i, seed in enumerate([11, 12, 13, 14])]
    assert together == alone
    assert sample(batch, [11, 12, 13, 14]) == together  # the same seeds, the same draws
