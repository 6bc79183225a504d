"""Training with a plan: `plan.apply(model, optimizer)` returns `step.TrainingStep`.

`step` (split, accumulate exactly, step, recover from an OOM) · `offload_link` / `model_link` /
`eight_bit_link` (the user's optimizer and model kept consistent when another optimizer steps; `state_hooks`,
the optimizer hooks both links share) · `clipping` (the global gradient norm) · `buffers` (what a failed
attempt changed, put back). The collectives over ranks live in `autotune.parallel`.
"""
