"""Reading ``metrics.jsonl`` back and drawing it (matplotlib, imported only when a plot is drawn)."""
