"""The vLLM backend: engine actors (``engine``), their group (``engines``), the worker extension and the judge's
engines."""
