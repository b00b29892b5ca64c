"""Rollouts: where an RL step's samples come from, and the engines that generate them.

* The sources of samples (:mod:`~rlhf.rollout.sources`: single-turn and environment episodes;
  :mod:`~rlhf.rollout.agent`: an agent's episodes through the endpoint), the prompts they start from
  (:mod:`~rlhf.rollout.prompts`) and the episodes' turn and token bookkeeping (``episodes``, ``multi_turn``,
  ``observations``, ``transcripts``).
* Backend-neutral types (:mod:`~rlhf.rollout.types`) and the backend protocol (:mod:`~rlhf.rollout.backend`).
* Three walled wings: ``vllm/`` (the engine actors), ``weights/`` (the policy -> engine weight sync), ``openai/``
  (the OpenAI-compatible endpoint agents talk to).
"""
