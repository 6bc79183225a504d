"""The search behind `autotune.fit`: which trial runs next and which plan wins.

`controller` (decisions only; takes a trial runner, so tests inject fakes) · `trial` (apply a
configuration, run real optimizer steps, measure time and peak memory, clean up) · `snapshot` (the model,
optimizer and random state restored after every trial).
"""
