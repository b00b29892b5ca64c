"""Load an environment class, or an agent function, from a spec: ``path/to/file.py:Class`` or ``package.module:Class``
(``:run`` for a function).

Specs are read as reward function specs are (:mod:`rlhf.utils.specs`: a file is executed once per process as a
private module; a relative path is relative to the working directory); every error is an :class:`EnvError`
naming the spec.
"""

from __future__ import annotations

import inspect
from typing import Any

from rlhf.envs.base import EnvError
from rlhf.utils import specs
from rlhf.utils.specs import SpecKind, defined_classes, load_module, resolve_attr, split_spec

__all__ = ["load_environment", "absolute_spec", "is_agent"]

_KIND = SpecKind(
    noun="environment spec", what="Class", error=EnvError, file_prefix="_rlhf_env_file_", listing="Classes"
)


def load_environment(spec: str) -> Any:
    """The environment class named by ``spec`` (instances are made with no arguments, one per episode), or the agent
    function it names (:mod:`rlhf.envs.agents`: ``run(client, row)``, sync or ``async``).

    Raises:
        EnvError: naming ``spec`` when it is malformed, the file does not exist or fails to execute, the module
            cannot be imported, the attribute is missing (with close matches and the classes available there), it
            is not a class, it lacks a callable ``reset`` or ``step``, or its constructor needs arguments.
    """
    target, attr = split_spec(spec, _KIND)
    cls: Any = resolve_attr(spec, target, attr, load_module(spec, target, _KIND), _KIND, available=defined_classes)
    if inspect.isfunction(cls):
        return _agent_function(spec, cls)
    if not inspect.isclass(cls):
        raise EnvError(
            f"environment spec {spec!r}: {attr} is not a class or a function (it is {type(cls).__name__}); name "
            f"an environment class, whose instances have reset(row) and step(response, response_ids), or an agent "
            f"function run(client, row)",
            spec,
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(
            f"environment spec {spec!r}: class {cls.__name__} has no {' or '.join(missing)} method; an "
            f"environment needs reset(row) -> str and step(response, response_ids) -> StepOutcome",
            spec,
        )
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: constructing it will tell
        return cls
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise EnvError(
            f"environment spec {spec!r}: {cls.__name__}() must be callable with no arguments (one "
            f"instance is made per episode); its constructor requires {', '.join(required)}",
            spec,
        )
    return cls


def absolute_spec(spec: str) -> str:
    """``spec`` with a relative file path made absolute (:func:`rlhf.utils.specs.absolute_spec`), so a pool actor
    loads the same file."""
    return specs.absolute_spec(spec, _KIND)


def is_agent(loaded: Any) -> bool:
    """Whether what :func:`load_environment` returned is an agent function (else an environment class)."""
    return inspect.isfunction(loaded)


def _agent_function(spec: str, fn: Any) -> Any:
    """An agent function must take ``(client, row)``: the episode's OpenAI client and its prompt row."""
    try:
        inspect.signature(fn).bind(object(), {})
    except TypeError:
        raise EnvError(
            f"environment spec {spec!r}: agent function {fn.__name__}{inspect.signature(fn)} must take (client, row): "
            f"an OpenAI client of the episode's endpoint and the prompt row",
            spec,
        ) from None
    return fn
