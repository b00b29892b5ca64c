"""Drawing runs' metric rows as panels per step (matplotlib, imported only when a plot is drawn); the rows are read
back from ``metrics.jsonl`` by :func:`rlhf.utils.metrics.read_metrics`."""
