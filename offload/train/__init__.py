"""Training: the plan (decisions and bytes), the parts built from it, the engine that runs a
step from them, its state, checkpoints and activation offload. See README.md beside this file."""
