"""Trainers: the driver side of SFT, reward modelling, DPO (``offline``) and the PPO family (``rl_runner.train_ppo``),
each a set of steps run by :class:`rlhf.trainers.run.Run`."""
