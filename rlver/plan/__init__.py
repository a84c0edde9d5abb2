"""GPU memory per phase before anything is allocated: a policy's architecture without downloading
it (`architectures`), what memory depends on besides it (`training_shape`) and the plan itself
(`memory_plan`, behind `rlver plan` and `rlver fit`'s check).

May import `rlver.core`, `rlver.parallel` and `rlver.modeling`. Reads settings as plain values from
the recipe or the run, never the classes of the training side (`rlver.train`) or `rlver.rollout`.
"""
