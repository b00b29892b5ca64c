"""Model construction helpers."""
