"""Measuring a model's empathy: the Sentient score, leaderboard and plots (`score`), a simulator's
agreement with recorded dialogues (`agreement`), and t intervals of means and paired changes
(`intervals`).

May import `rlver.core`, `rlver.data` and `rlver.rollout` (transcripts). Never trains.
"""
