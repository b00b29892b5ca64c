"""Pure tensor maths for training: token log-probs, entropies, masked reductions and losses.

Nothing in this package imports Ray, DeepSpeed, vLLM, transformers or the config system; every function takes
tensors and returns tensors, so each one can be checked by hand on tiny inputs.

Normalization rule: losses come back as *sums* (or per-sample values), never as a mean over a micro-batch. The
caller divides once by a normalizer counted over the whole global batch (all micro-batches on all ranks), see
:func:`rlhf.ops.losses.normalize`.
"""
