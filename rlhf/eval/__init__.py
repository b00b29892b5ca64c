"""Evaluation helpers (generation accuracy on tasks with checkable answers)."""
