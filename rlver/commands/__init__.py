"""rlver's commands besides the Trainer's run itself: recipes parsed as `rlver fit` reads them
(`recipes`, also rlver's LightningCLI), `rlver rollout` (`rollout`), the commands that run no
dialogue: `plugins`, `export`, `score`, `plan` (`standalone`), and `rlver ablate` (`ablate`, its runs
on disk in `ablation_runs`).

May import every other subpackage; only `rlver.cli` imports it (the `rlver` entry point, which
quiets the libraries' logging before anything here loads torch).
"""
