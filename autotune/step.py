"""Kept so that `from autotune.step import TrainingStep` still works; the step lives in `training/step.py`."""

from .training.step import TrainingStep

__all__ = ["TrainingStep"]
