"""Load user reward functions from specs, call them on a batch, validate and weight what they return.

See :mod:`rlhf.rewards` for the function signature, the column -> parameter rule and the accepted results.

Specs:

* ``path/to/file.py:function``: the file is executed as a fresh module under a unique private name
  (``_rlhf_reward_file_<stem>_<hash>_<n>``), so it never shadows or replaces a module of the same name
  (``rewards.py`` does not become ``import rewards``). The module stays registered under that private name so
  that pickling, dataclasses and tracebacks inside it work. A file is executed once per process while it is
  unchanged (same modification time and size); an edited file is executed again. A relative path is relative
  to the working directory. Siblings of the file are not importable from it unless its directory is on
  ``sys.path``; use the module form for a package of reward code.
* ``package.module:function``: imported with :func:`importlib.import_module`.

The function name may be dotted (``module:Class.method``). A trailing ``@WEIGHT`` (``my.py:fn@0.5``) weights the
source in :func:`parse_reward_specs`; an ``@`` before the last ``:`` belongs to the path. Spec splitting, file
execution and attribute lookup are shared with environments (:mod:`rlhf.utils.specs`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from rlhf.utils.specs import SpecKind, clip_plain, load_module, looks_like_path, resolve_attr, split_spec

__all__ = [
    "RewardFunctionError",
    "RewardSource",
    "RewardFunctionScorer",
    "load_reward_function",
    "parse_reward_specs",
    "compute_rewards",
]

_PREVIEW_CHARS = 200  # prompts, responses and values quoted in error messages are cut to this length

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded, cannot be called with the available columns, raised, or returned
    something that is not one finite real number per response. The message names the function (its spec) and,
    when one sample is at fault, that sample."""


REWARD_SPEC = SpecKind(
    noun="reward function spec", what="function", error=RewardFunctionError, file_prefix="_rlhf_reward_file_"
)


# ----------------------------------------------------------------------------------------------------------------
# Specs and loading
# ----------------------------------------------------------------------------------------------------------------


def clip_preview(text: Any, limit: int = _PREVIEW_CHARS) -> str:
    """``repr`` of a string cut to ``limit`` characters, saying how much was cut."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text) - limit} more chars)"


def _split_spec(spec: Any) -> Tuple[str, str]:
    """``"target:attr"`` -> ``(target, attr)``, checking the form only (nothing is imported)."""
    return split_spec(spec, REWARD_SPEC)


def split_weight(spec: Any) -> Tuple[str, float]:
    """``"SPEC@WEIGHT"`` -> ``(SPEC, WEIGHT)``; no ``@`` after the last ``:`` means weight 1.0."""
    if not isinstance(spec, str):
        raise RewardFunctionError(
            f"a reward spec must be a string like 'my_rewards.py:fn@0.5', got {type(spec).__name__} {spec!r}"
        )
    text = spec.strip()
    head, sep, tail = text.rpartition("@")
    if not sep or ":" in tail:  # no '@', or the '@' is part of the path (before the last ':')
        return text, 1.0
    try:
        weight = float(tail)
    except ValueError:
        raise RewardFunctionError(
            f"reward spec {spec!r}: weight {tail!r} after '@' is not a number (write e.g. 'my_rewards.py:fn@0.5')"
        ) from None
    if not math.isfinite(weight):
        raise RewardFunctionError(f"reward spec {spec!r}: weight must be a finite number, got {tail!r}")
    return head.strip(), weight


def _check_batch_signature(spec: str, fn: Callable) -> None:
    """The function must take prompts and responses as its first two positional arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; calling them will tell
        return
    if _positional_split(signature)[0]:
        raise RewardFunctionError(
            f"reward function spec {spec!r}: the function must accept (prompts, responses, "
            f"...) as its first two positional parameters; its signature is {signature}"
        )


def load_reward_function(spec: str) -> Callable:
    """The callable named by ``spec`` (``path/to/file.py:function`` or ``package.module:function``).

    Raises:
        RewardFunctionError: naming ``spec`` when the spec is malformed, the file does not exist, the module cannot
            be imported (with the import error), the attribute is missing (listing the callables available there),
            the attribute is not callable, or it cannot take ``(prompts, responses)`` positionally.
    """
    target, attr = _split_spec(spec)
    obj = resolve_attr(spec, target, attr, load_module(spec, target, REWARD_SPEC), REWARD_SPEC)
    if not callable(obj):
        raise RewardFunctionError(
            f"reward function spec {spec!r}: {attr} is not callable (it is "
            f"{type(obj).__name__} {clip_plain(repr(obj), 80)})"
        )
    _check_batch_signature(spec, obj)
    return obj


# ----------------------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSource:
    """One reward function with the name used in metrics and error messages, and its weight in the total."""

    name: str
    fn: Callable
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RewardFunctionError(f"RewardSource.name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise RewardFunctionError(f"reward source {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(float(w)):
            raise RewardFunctionError(f"reward source {self.name!r}: weight must be a finite number, got {w!r}")
        object.__setattr__(self, "weight", float(w))


def _check_specs(specs: Sequence[str]) -> List[Tuple[str, float]]:
    """``(name, weight)`` per spec, checking the form, the weights and duplicate names without importing."""
    if isinstance(specs, (str, bytes)):
        raise RewardFunctionError(
            f"reward specs must be a list of strings, got the single string {specs!r}; wrap it in a list"
        )
    parsed: List[Tuple[str, float]] = []
    seen: Dict[str, str] = {}
    for spec in specs:
        name, weight = split_weight(spec)
        _split_spec(name)
        if name in seen:
            raise RewardFunctionError(
                f"reward spec {spec!r} names the same function as {seen[name]!r}; each "
                f"function may be listed once (combine the weights)"
            )
        seen[name] = spec
        parsed.append((name, weight))
    return parsed


def parse_reward_specs(specs: Sequence[str]) -> List[RewardSource]:
    """Load ``SPEC`` or ``SPEC@WEIGHT`` strings (``rlhf.synthetic.arithmetic:reward@1.0``,
    ``my_rewards.py:format_bonus@0.1``) into sources named by ``SPEC``; the weight defaults to 1.0.

    Raises:
        RewardFunctionError: naming the spec, for a bad weight, a duplicate, or anything
            :func:`load_reward_function` rejects.
    """
    return [
        RewardSource(name=name, fn=load_reward_function(name), weight=weight) for name, weight in _check_specs(specs)
    ]


# ----------------------------------------------------------------------------------------------------------------
# Calling
# ----------------------------------------------------------------------------------------------------------------


def _positional_split(signature: inspect.Signature) -> Tuple[int, set, List[inspect.Parameter]]:
    """``(slots_left, names_of_first_two, remaining_parameters)``: the first two positional slots take prompts and
    responses (a ``*args`` takes whatever is left of them); ``slots_left > 0`` means the function cannot take both.
    """
    slots = 2
    first_names: set = set()
    rest: List[inspect.Parameter] = []
    for p in signature.parameters.values():
        if slots and p.kind in _POSITIONAL:
            slots -= 1
            first_names.add(p.name)
        elif slots and p.kind is inspect.Parameter.VAR_POSITIONAL:
            slots = 0
        else:
            rest.append(p)
    return slots, first_names, rest


def _match_column(param: str, columns: Sequence[str]) -> Optional[str]:
    """The column for parameter ``param``: the same name, else (for ``<col>s``) the name without the final s."""
    if param in columns:
        return param
    if param.endswith("s") and len(param) > 1 and param[:-1] in columns:
        return param[:-1]
    return None


def bind_columns(source: RewardSource, columns: Sequence[str]) -> Dict[str, str]:
    """Keyword argument -> column name, for the columns ``source.fn`` declares (see :mod:`rlhf.rewards`)."""
    try:
        signature = inspect.signature(source.fn)
    except (TypeError, ValueError):  # no introspectable signature: pass prompts and responses only
        return {}
    slots, first_names, rest = _positional_split(signature)
    if slots:
        raise RewardFunctionError(
            f"reward function {source.name!r} must accept (prompts, responses, ...) as its "
            f"first two positional parameters; its signature is {signature}"
        )
    available = ", ".join(repr(c) for c in columns) if columns else "none"
    binding: Dict[str, str] = {}
    takes_all = False
    for p in rest:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            takes_all = True
            continue
        has_default = p.default is not inspect.Parameter.empty
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            if has_default:
                continue
            raise RewardFunctionError(
                f"reward function {source.name!r}: parameter {p.name!r} is positional-only, "
                f"so no column can be passed to it by name; make it a regular parameter"
            )
        column = _match_column(p.name, columns)
        if column is not None:
            binding[p.name] = column
        elif not has_default:
            looked = repr(p.name) + (f" or {p.name[:-1]!r}" if p.name.endswith("s") and len(p.name) > 1 else "")
            raise RewardFunctionError(
                f"reward function {source.name!r} needs parameter {p.name!r} but no column matches it (looked for "
                f"column {looked}); available columns: {available}. Add the field to the prompt data or give the "
                f"parameter a default"
            )
    if takes_all:
        used = set(binding.values())
        for column in columns:
            if column in used:
                continue
            if column in first_names:
                raise RewardFunctionError(
                    f"reward function {source.name!r}: column {column!r} would reach "
                    f"**kwargs under the name of its parameter {column!r}; rename the "
                    f"parameter or the dataset field"
                )
            binding[column] = column
    return binding


def _call_error(
    source: RewardSource,
    error: Exception,
    binding: Mapping[str, str],
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Mapping[str, Sequence],
) -> RewardFunctionError:
    """The error for a function that raised on the batch, naming the first sample that fails on its own."""
    n = len(prompts)
    head = (
        f"reward function {source.name!r} raised {type(error).__name__}: {clip_plain(str(error), 500)} "
        f"on a batch of {n}"
    )
    for i in range(n):
        kwargs = {param: [columns[col][i]] for param, col in binding.items()}
        try:
            source.fn([prompts[i]], [responses[i]], **kwargs)
        except Exception as e:
            return RewardFunctionError(
                f"{head}; the first sample that fails on its own is index {i} ({type(e).__name__}: "
                f"{clip_plain(str(e), 500)}): prompt={clip_preview(prompts[i])}; response={clip_preview(responses[i])}"
            )
    return RewardFunctionError(
        f"{head}; every sample succeeds on its own, so the failure depends on the batch, not on one sample"
    )


def _bad_value(
    source: RewardSource, i: int, n: int, what: str, value: Any, prompts: Sequence[str], responses: Sequence[str]
) -> RewardFunctionError:
    return RewardFunctionError(
        f"reward function {source.name!r} returned {what} at index {i} of {n}: "
        f"{clip_plain(repr(value), _PREVIEW_CHARS)}; "
        f"prompt={clip_preview(prompts[i])}; response={clip_preview(responses[i])}"
    )


def _scalar(x: Any) -> Tuple[Optional[float], str]:
    """``(value, "")`` for a real number, else ``(None, what is wrong)``."""
    if isinstance(x, (bool, np.bool_)):
        return None, "a bool (return float(...) to use it as 0/1)"
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            return None, f"a tensor of shape {tuple(x.shape)} instead of a number"
        if x.dtype == torch.bool:
            return None, "a bool tensor (return float(...) to use it as 0/1)"
        if x.is_complex():
            return None, "a non-numeric value (complex)"
        return float(x.item()), ""
    if isinstance(x, np.ndarray) and x.ndim == 0:
        return _scalar(x[()])
    if isinstance(x, numbers.Real):
        try:
            return float(x), ""
        except OverflowError:
            return None, "a value too large for a float"
    return None, f"a non-numeric value ({type(x).__name__})"


def result_values(source: RewardSource, result: Any, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
    """Validate one function's result and return it as a float32 ``(N,)`` tensor."""
    n = len(prompts)
    where = f"reward function {source.name!r}"
    expected = f"a list, tuple, 1-D numpy array or 1-D torch tensor of {n} numbers (one per response)"

    def wrong_length(m: int) -> RewardFunctionError:
        return RewardFunctionError(
            f"{where} returned {m} values for a batch of {n} responses (expected {n}, got "
            f"{m}); it must return one reward per response"
        )

    if not isinstance(result, (torch.Tensor, np.ndarray, str, bytes, bytearray, _SequenceABC)) and hasattr(
        result, "__array__"
    ):  # pandas Series, jax arrays, ...
        result = np.asarray(result)

    if isinstance(result, (torch.Tensor, np.ndarray)):
        shape = tuple(result.shape)
        if len(shape) != 1:
            raise RewardFunctionError(
                f"{where} returned a {type(result).__name__} of shape {shape}; expected shape ({n},): {expected}"
            )
        if shape[0] != n:
            raise wrong_length(shape[0])
    if isinstance(result, torch.Tensor):
        if result.dtype == torch.bool or result.is_complex():
            values = None
            items: Sequence = result.tolist() if result.dtype == torch.bool else list(result)
        else:
            values = result.detach().to("cpu", torch.float64)
    elif isinstance(result, np.ndarray):
        if result.dtype.kind in "iuf":
            values = torch.from_numpy(result.astype(np.float64))
        else:  # object arrays are checked element by element; bool/str/complex/datetime arrays fail there
            values, items = None, list(result)
    elif isinstance(result, _SequenceABC) and not isinstance(result, (str, bytes, bytearray)):
        if len(result) != n:
            raise wrong_length(len(result))
        values, items = None, result
    else:
        raise RewardFunctionError(
            f"{where} returned {type(result).__name__} {clip_plain(repr(result), 80)}; expected {expected}"
        )

    if values is None:
        floats = []
        for i, x in enumerate(items):
            value, what = _scalar(x)
            if value is None:
                raise _bad_value(source, i, n, what, x, prompts, responses)
            floats.append(value)
        values = torch.tensor(floats, dtype=torch.float64)

    out = values.to(torch.float32)
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        original = float(values[i])
        what = "a non-finite value" if not math.isfinite(original) else "a value that overflows float32"
        raise _bad_value(source, i, n, what, original, prompts, responses)
    return out


def metric_names(names: Sequence[str]) -> Dict[str, str]:
    """The name each source's metric is logged under (``reward/<name>``): a function in a file is named by the file's
    base name and the function (``rewards.py:correct``, not the whole path); a module's keeps its spec
    (``rlhf.synthetic.arithmetic:reward``); the remote reward's (``http:<url>``) is ``http``, the judge's ``judge``.
    Names two files would share keep their whole paths."""
    short = {}
    for name in names:
        if name.startswith(("http:", "judge:")):  # reward.http, reward.judge: reward/http, reward/judge
            short[name] = name.split(":", 1)[0]
            continue
        target, _, function = name.rpartition(":")
        short[name] = f"{os.path.basename(target)}:{function}" if looks_like_path(target) else name
    taken = list(short.values())
    return {name: (s if taken.count(s) == 1 else name) for name, s in short.items()}


def compute_rewards(
    sources: Sequence[RewardSource],
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Optional[Mapping[str, Sequence]] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Score a batch with every source: each function is called once, on the whole batch.

    Args:
        sources: The reward sources (at least one; names must be distinct).
        prompts: ``N`` prompts.
        responses: ``N`` responses, one per prompt.
        columns: Extra dataset fields of the prompt rows, ``{field name: list of N values}``; each function
            receives the ones its signature declares (see :mod:`rlhf.rewards`). Each function gets its own copies
            of the lists, so one that mutates its inputs cannot affect another.

    Returns:
        ``(total, per_source)``: the weighted sum, float32 ``(N,)``, and each source's unweighted float32 ``(N,)``
        rewards by name. With ``N == 0`` no function is called (the column binding is still checked).

    Raises:
        RewardFunctionError: for misaligned inputs, a parameter no column can fill, a function that raises (naming
            the first sample that fails on its own), a result of the wrong type or length, or a bool, non-numeric
            or non-finite value (naming its index, prompt and response).
    """
    sources = list(sources)
    if not sources:
        raise RewardFunctionError("compute_rewards needs at least one reward source")
    names = [s.name for s in sources]
    duplicates = sorted({x for x in names if names.count(x) > 1})
    if duplicates:
        raise RewardFunctionError(f"reward source names must be distinct; repeated: {', '.join(duplicates)}")
    n = len(prompts)
    if len(responses) != n:
        raise RewardFunctionError(f"compute_rewards: got {n} prompts but {len(responses)} responses")
    columns = dict(columns or {})
    for key, column in columns.items():  # not ``values``: that name holds each source's reward tensor below
        if not isinstance(key, str):
            raise RewardFunctionError(f"compute_rewards: column names must be strings, got {key!r}")
        if isinstance(column, (str, bytes)) or not hasattr(column, "__len__") or len(column) != n:
            got = f"{len(column)} values" if hasattr(column, "__len__") else type(column).__name__
            raise RewardFunctionError(
                f"compute_rewards: column {key!r} must be a list of {n} values (one per prompt), got {got}"
            )
    column_names = list(columns)
    prompts, responses = list(prompts), list(responses)

    per_source: Dict[str, torch.Tensor] = {}
    total = torch.zeros(n, dtype=torch.float64)
    for source in sources:
        binding = bind_columns(source, column_names)
        if n == 0:
            values = torch.zeros(0, dtype=torch.float32)
        else:
            kwargs = {param: list(columns[col]) for param, col in binding.items()}
            try:
                result = source.fn(list(prompts), list(responses), **kwargs)
            except Exception as e:
                raise _call_error(source, e, binding, prompts, responses, columns) from e
            values = result_values(source, result, prompts, responses)
        per_source[source.name] = values
        total += source.weight * values.to(torch.float64)

    total32 = total.to(torch.float32)
    if not bool(torch.isfinite(total32).all()):
        i = int((~torch.isfinite(total32)).nonzero()[0, 0])
        raise RewardFunctionError(
            f"the weighted total reward at index {i} overflows float32 ({float(total[i])}); "
            f"sources: {', '.join(f'{s.name}@{s.weight}' for s in sources)}"
        )
    return total32, per_source


# ----------------------------------------------------------------------------------------------------------------
# A picklable scorer
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunctionScorer:
    """Reward functions named by specs (``SPEC`` or ``SPEC@WEIGHT``), loaded on first use.

    It holds only the spec strings, so it pickles and can be shipped to a Ray actor, which loads the functions in
    its own process on the first call (or on :meth:`load`, to fail at start-up) and caches them. Spec form,
    weights and duplicates are checked at construction, without importing anything.
    """

    specs: Tuple[str, ...]
    _sources: Optional[List[RewardSource]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        specs = tuple(self.specs) if not isinstance(self.specs, (str, bytes)) else self.specs
        if isinstance(specs, tuple) and not specs:
            raise RewardFunctionError("RewardFunctionScorer needs at least one reward spec")
        _check_specs(specs)
        object.__setattr__(self, "specs", specs)

    @property
    def names(self) -> List[str]:
        """The source names (the specs without their weights), in order; nothing is loaded."""
        return [name for name, _ in _check_specs(self.specs)]

    def load(self) -> List[RewardSource]:
        """Load (once per process) and return the sources."""
        if self._sources is None:
            object.__setattr__(self, "_sources", parse_reward_specs(self.specs))
        return list(cast(List[RewardSource], self._sources))  # set just above when it was None

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], columns: Optional[Mapping[str, Sequence]] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """:func:`compute_rewards` with this scorer's sources."""
        return compute_rewards(self.load(), prompts, responses, columns)

    def __getstate__(self) -> Dict[str, Any]:  # never ship loaded function objects
        return {"specs": self.specs}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        object.__setattr__(self, "specs", tuple(state["specs"]))
        object.__setattr__(self, "_sources", None)
