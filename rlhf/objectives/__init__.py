"""Training objectives: what one micro-batch contributes to a global-batch loss.

An objective is a small picklable object that crosses from the driver to the trainer workers. Its contract:

* ``count(batch) -> int`` (driver side): this micro-batch's share of the normalizer: target tokens for
  token-level losses, pairs for sequence-level ones. The driver sums it over every micro-batch of every rank
  *before* the first backward, so the loss of the whole global batch is normalized exactly once.
* ``loss(model, batch) -> (loss_sum, sums)`` (worker side): the un-normalized loss *sum* of the micro-batch and
  named metric sums (counts and sums only: never means, so they add up across micro-batches and ranks).
* ``finalize(sums, normalizer) -> metrics`` (driver side): turns the summed-over-everything sums into the
  logged numbers, each divided once by its global count.
"""

from rlhf.objectives.base import Objective, ScoreFn  # noqa: F401
