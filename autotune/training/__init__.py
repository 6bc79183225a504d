"""Training with a plan: `plan.apply(model, optimizer)` returns `step.TrainingStep`.

`step` (split, accumulate exactly, step, recover from an OOM) · `distributed` (agreement and gradient
reduction over ranks) · `offload_link` (the optimizer step on the host when the plan offloads it).
"""
