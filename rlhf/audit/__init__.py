"""``python -m rlhf.cli.audit``: check a run config against the gradient-accumulation contract before a real run.

Two parts, each usable alone:

* :mod:`rlhf.audit.lint`: the known hazards of a config (a ``communication_data_type`` that zeroes the loss, fp16
  without loss scaling, a global batch that does not split or leaves rows unused, ``train.max_steps`` beyond what
  the epochs give, a DeepSpeed JSON that contradicts the run), each naming its key. Pure: no run.
* :mod:`rlhf.audit.runner`: the first N optimizer steps of the run under the configured (micro x accumulation x
  ranks) and under other factorisations of the same global batch (:mod:`rlhf.audit.factorizations`), through the
  real trainers; :mod:`rlhf.audit.compare` turns their logged rows and final weights into a per-step table and a
  verdict.

Importing this package, and its pure modules, starts nothing and imports no Ray, DeepSpeed or vLLM.
"""
