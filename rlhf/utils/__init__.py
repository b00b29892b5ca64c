"""Small shared utilities (device capability, LR schedules, library versions, metric writers and the W&B sink)."""
