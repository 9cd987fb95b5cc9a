"""Training draft heads by self-distillation: prompt sets, data from the target, head training."""
