"""Training: the LightningModule (`module`, the algorithm's numbered steps) and what it delegates
to: settings and plugins (`components`), rewards, scoring and advantages (`scoring`), the PPO /
GRPO update (`ppo_update`) in lockstep across ranks (`ranks`), logging (`run_log`), validation
and test (`evaluation`), the difficulty curriculum, the Trainer (`trainer`, `progress`) and the
callbacks recipes add (`callbacks`).

May import every subpackage below it; only `rlver.commands` and `rlver.cli` import it.
"""
