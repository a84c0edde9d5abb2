"""The RL maths as pure tensor functions: advantages, losses, KL estimators."""
