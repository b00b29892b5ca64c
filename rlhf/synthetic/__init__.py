"""Synthetic tasks with checkable answers, for tests, examples and demos."""
