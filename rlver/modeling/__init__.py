"""The networks and the tensors they read: model resolution and loading (`models`), numeric
precision, LoRA, the critic, building the policy / critic / reference and their optimizers
(`networks`), finished dialogues as training tensors (`batch`), the policy's log-probs where the
loss reads (`loss_positions`) and a shared prompt run once (`shared_prefix`).

May import `rlver.core`, `rlver.rl` and `rlver.parallel`. Runs no rollout and no update. Engine
plugins may import from here (the policy they generate from, its dtype and forward passes).
"""
