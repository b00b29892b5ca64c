"""rlhf."""
