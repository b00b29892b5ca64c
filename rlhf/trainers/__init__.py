"""Trainers, a core and two wings.

* The core (this folder): :class:`~rlhf.trainers.run.Run`, the one loop every trainer's steps run in (checkpoints,
  health, interrupts, the output directory), the start-up checks every run makes (:mod:`~rlhf.trainers.preflight`),
  the actors' start (:mod:`~rlhf.trainers.actors`) and a trainer's descriptor (:mod:`~rlhf.trainers.descriptor`).
* ``offline/``: SFT, the reward model and the DPO family over one offline loop.
* ``online/``: the PPO family (``online.runner.train_ppo``): its roles, prompts, steps, schedule and RL-only checks.
* :mod:`~rlhf.trainers.kinds`: every trainer's descriptor by name, above both wings (what the command lines, the
  dry run and the audit look trainers up in). The core and the wings never import it: a trainer hands the core its
  own descriptor.
"""
