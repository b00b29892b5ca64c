"""Reward sources for online RL: user-written rule-based (verifiable) reward functions.

A reward function scores a batch of generated responses::

    def my_reward(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]: ...

It is named on the command line / in a config by a spec, ``path/to/file.py:function`` or
``package.module:function``, optionally weighted with ``@WEIGHT`` (``my_rewards.py:format_bonus@0.1``).
:func:`rlhf.rewards.functions.parse_reward_specs` turns specs into :class:`RewardSource` objects and
:func:`rlhf.rewards.functions.compute_rewards` calls each once per batch, validates what it returns and sums the
weighted results. :class:`RewardFunctionScorer` does both lazily from spec strings, so it pickles and can be
shipped to a Ray actor.

**Columns.** The extra fields of each prompt row (everything besides the prompt itself) reach the function as
columns, lists aligned with the prompts, keyed by their dataset field name. The function's signature decides
what it receives; its first two positional parameters get ``prompts`` and ``responses`` (any names), and every
further parameter ``p`` is matched by name:

1. a column named exactly ``p`` (``answer`` -> ``answer``);
2. otherwise, if ``p`` ends in ``s``, a column named ``p`` without the ``s`` (parameter ``answers`` receives
   column ``answer``; this is how :func:`rlhf.synthetic.arithmetic.reward` gets its references);
3. otherwise the parameter's default is used; a parameter with no column and no default is an error that names
   the function, the parameter and the available columns.

A function with ``**kwargs`` additionally receives every column not bound to a named parameter, under its
dataset field name. Columns the function does not declare are not passed.

**Results.** A function returns a list, tuple, 1-D numpy array or 1-D torch tensor with one real number per
response. Ints are accepted; bools are rejected (write ``float(ok)``), as are NaN, infinities, values that do not
fit float32 and anything non-numeric. Every failure (a raising function, a wrong length, a bad value) raises
:class:`RewardFunctionError` naming the function and, when one sample is at fault, its index, prompt and
response.

Trained reward models are served by Ray actors elsewhere; this package only covers reward functions.
"""

from rlhf.rewards.functions import (  # noqa: F401
    RewardFunctionError,
    RewardFunctionScorer,
    RewardSource,
    compute_rewards,
    load_reward_function,
    parse_reward_specs,
)
