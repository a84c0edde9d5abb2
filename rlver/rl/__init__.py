"""The RL maths as pure tensor functions: advantages, losses, KL estimators.

Imports nothing else from rlver: the maths knows tensors, not trajectories or models. Advantage
plugins may import from here.
"""
