"""What the search and the training step share about the user's job, below both of them.

`batch` (slicing and measuring batches) · `losses` (the loss of a micro-batch and its weight) ·
`optimizers` (rebuilding the user's optimizer) · `accumulation` (loss weights that make accumulated
gradients exact) · `batching` (the pure arithmetic: accumulation solve, memory slope, bisection).
"""
