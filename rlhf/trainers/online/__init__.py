"""Online RL, the PPO family: the runner (``train_ppo``), its roles, prompts, steps, schedule and RL-only checks."""
