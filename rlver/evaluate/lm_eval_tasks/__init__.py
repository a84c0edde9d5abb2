"""rlver's offline lm-eval tasks: YAML configs that lm-eval reads from this folder (`include_path`) and
the functions they name. A package so the wheel installs and imports it like every other module;
lm-eval itself loads `offline_tasks.py` by path."""
