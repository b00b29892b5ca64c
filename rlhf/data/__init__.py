"""Reading and preparing training data."""
