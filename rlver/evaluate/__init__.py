"""Measuring a model's empathy: the Sentient score, leaderboard and plots (`score`), a simulator's
agreement with recorded dialogues (`agreement`), t intervals of means and paired changes
(`intervals`), and an ablation's statistics and tables (`ablation`, `ablation_report`).

May import `rlver.core`, `rlver.data` and `rlver.rollout` (transcripts). Never trains.
"""
