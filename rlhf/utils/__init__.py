"""Small shared utilities (device capability, LR schedules, atomic files, metric writers)."""
