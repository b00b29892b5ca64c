"""Trainers: the driver side of SFT, reward modelling and DPO (PPO-family trainers build on the same parts)."""
