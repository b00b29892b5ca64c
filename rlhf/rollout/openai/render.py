"""OpenAI ``/v1/chat/completions`` and ``/v1/completions`` rendering over the project's own vLLM engines.

Agent code in an RL rollout speaks the OpenAI API; generation goes through :class:`rlhf.rollout.vllm.engine.VLLMEngine`
(token ids in, token ids and sampling log-probs out), not through vLLM's own ``AsyncLLM`` server. This module is the
layer between them, and it is vLLM's: the pieces of vLLM's disaggregated *render server*
(``vllm/entrypoints/launchers/render/app_state.py``), built once per model directory, on the CPU, with no engine:

* ``OnlineRenderer`` validates and renders a request: the chat template (with ``tools``), the tool parser's
  ``adjust_request``, tokenization, the context-length checks: request -> prompt token ids.
* ``OnlineDerenderer`` turns sampled token ids back into OpenAI choices: incremental detokenization seeded with the
  prompt, log-prob decoding, and the tool-call / reasoning parsers (``tool_parser="hermes"`` etc.).

Request fields (what happens to each):

* Honoured here: ``messages`` / ``prompt`` (text or token ids, one or several prompts), ``tools``, ``tool_choice``
  (``"none"`` / ``"auto"``; ``"required"`` and a named tool need the engine's structured outputs, which
  :meth:`SamplingAsk.sampling_spec` rejects), ``chat_template_kwargs``, ``add_generation_prompt``,
  ``continue_final_message``, ``logprobs`` (the sampled token's log-prob), ``return_token_ids`` (vLLM's extension:
  ``prompt_token_ids`` and each choice's ``token_ids``, the exact ids the trainer sees), ``skip_special_tokens``.
* Resolved as vLLM's server resolves them, and handed to the caller as :class:`SamplingAsk`: ``max_tokens`` /
  ``max_completion_tokens`` (capped by the context left), ``n``, ``seed``, ``stop_token_ids``.
* Overridden by training: ``temperature``, ``top_p``, ``top_k``. The trainer's log-probs must be those of the
  distribution the rollout sampled from, which the RL config fixes; the request's values are kept in
  :class:`SamplingAsk` for the caller to log or refuse, and :meth:`SamplingAsk.sampling_spec` takes the run's.
* Refused (by :meth:`SamplingAsk.sampling_spec`, HTTP 400 naming the field): what the engine cannot do or what would
  change the sampled distribution behind the trainer's back: ``stop`` strings, top-``k`` alternatives
  (``top_logprobs`` > 0), penalties, ``min_p``, ``logit_bias``, ``min_tokens``, ``ignore_eos``, structured outputs
  (``response_format``, ``tool_choice="required"``), beam search, ``echo``.
* Not checked: ``model`` (an agent may send any name; the response carries ``served_model_name``).

The checkpoint's ``generation_config.json`` sampling defaults (Qwen's ``repetition_penalty``, ``top_k``, ...) are
not applied, unlike vLLM's server: the RL config decides how the rollout samples.

Errors: a bad request raises :class:`RenderError`, which carries vLLM's ``ErrorResponse`` (status code, message,
the offending field as ``param``) for an HTTP layer to return as it is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlhf.models.tiny import TOOLS_CHAT_TEMPLATE  # noqa: F401 - re-exported: tests and agents import it from here
from rlhf.rollout.types import Generation, SamplingSpec


class RenderError(Exception):
    """A request vLLM's serving code refuses. ``response``: vLLM's ``ErrorResponse`` (``.error.code`` is the HTTP
    status, ``.error.param`` the offending field when known); :meth:`to_dict` is the JSON body to return."""

    def __init__(self, response: Any) -> None:
        super().__init__(f"{response.error.code} {response.error.type}: {response.error.message}")
        self.response = response

    @property
    def status_code(self) -> int:
        return int(self.response.error.code)

    @property
    def param(self) -> Optional[str]:
        return self.response.error.param

    def to_dict(self) -> Dict[str, Any]:
        return self.response.model_dump(mode="json")


def _bad_request(message: str, param: Optional[str]) -> RenderError:
    from vllm.entrypoints.serve import create_error_response

    return RenderError(create_error_response(message, param=param))


def _as_render_error(exc: Exception) -> RenderError:
    """vLLM's mapping of an exception raised while rendering to an ``ErrorResponse`` (its server's)."""
    from pydantic import ValidationError
    from vllm.entrypoints.serve import create_error_response
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
    from vllm.exceptions import VLLMValidationError

    if not isinstance(exc, ValidationError):
        return RenderError(create_error_response(exc))
    # what vLLM's FastAPI handler for a body that fails validation says (its handler needs a live request)
    errors = exc.errors()
    first = errors[0]
    ctx_error = first.get("ctx", {}).get("error")
    param = ctx_error.parameter if isinstance(ctx_error, VLLMValidationError) else clean_loc_for_param(first["loc"])
    lines = [f"{clean_loc_for_param(e['loc'])}: {e['msg']}" for e in errors[:10]]
    label = "error" if len(errors) == 1 else "errors"
    return _bad_request(f"{len(errors)} validation {label}:\n  " + "\n  ".join(lines), param)


def _refuse_flags(request: Any) -> None:
    """Response shapes this layer does not produce: a stream (the endpoint's HTTP layer serves ``stream=true`` by
    sending the unstreamed response as chunks, rlhf/rollout/openai/stream.py), the prompt echoed, beams."""
    for field in ("stream", "echo", "use_beam_search"):
        if getattr(request, field):
            raise _bad_request(f"`{field}` is not supported by this endpoint", field)


@dataclass(frozen=True)
class SamplingAsk:
    """What a request asks of the sampler, resolved as vLLM's server resolves it (``to_sampling_params``).

    ``max_tokens``: the asked ``max_completion_tokens`` / ``max_tokens``, capped by the context the prompt leaves
    (``max_model_len - len(prompt)``). ``temperature`` / ``top_p`` / ``top_k``: as asked, ``None`` when not given;
    training overrides them (module docstring). ``logprobs``: ``None`` when not asked, else the number of top
    alternatives asked besides the sampled token (0: the sampled token's log-prob alone).
    """

    max_tokens: int
    n: int
    temperature: Optional[float]
    top_p: Optional[float]
    top_k: Optional[int]
    seed: Optional[int]
    stop_token_ids: Tuple[int, ...]
    logprobs: Optional[int]
    refused: Optional[Tuple[str, str]]  # (field, why) of the first ask the engine cannot honour; None: all can be

    def sampling_spec(self, temperature: float, top_p: float = 1.0, top_k: int = -1) -> SamplingSpec:
        """The engine's sampling for this request: the run's ``temperature`` / ``top_p`` / ``top_k`` (the request's
        are overridden), the request's ``max_tokens``, ``seed`` and ``stop_token_ids``. ``n`` is the caller's: it
        sends the prompt ``n`` times (sample ``i`` seeded ``seed + i``, so that the samples differ). Raises
        :class:`RenderError` (400) for an ask that cannot be honoured."""
        if self.refused is not None:
            field, why = self.refused
            raise _bad_request(f"`{field}` is not supported by this endpoint: {why}", field)
        return SamplingSpec(
            max_new_tokens=self.max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
        )


# (vLLM SamplingParams attribute, request field, the value that means "not asked", why it is refused)
_REFUSED: Tuple[Tuple[str, str, Any, str], ...] = (
    ("stop", "stop", [], "the engine stops on token ids only (`stop_token_ids`)"),
    ("presence_penalty", "presence_penalty", 0.0, "it changes the sampled distribution the trainer scores"),
    ("frequency_penalty", "frequency_penalty", 0.0, "it changes the sampled distribution the trainer scores"),
    ("repetition_penalty", "repetition_penalty", 1.0, "it changes the sampled distribution the trainer scores"),
    ("min_p", "min_p", 0.0, "it changes the sampled distribution the trainer scores"),
    ("logit_bias", "logit_bias", None, "it changes the sampled distribution the trainer scores"),
    ("allowed_token_ids", "allowed_token_ids", None, "it changes the sampled distribution the trainer scores"),
    ("bad_words", "bad_words", [], "it changes the sampled distribution the trainer scores"),
    ("structured_outputs", "response_format", None, "guided decoding is not wired into the rollout engine"),
    ("min_tokens", "min_tokens", 0, "the engine does not suppress EOS"),
    ("ignore_eos", "ignore_eos", False, "the engine always stops at EOS"),
    ("prompt_logprobs", "prompt_logprobs", None, "the engine returns no prompt log-probs"),
)


def _sampling_ask(request: Any, params: Any) -> SamplingAsk:
    """``params``: vLLM's ``SamplingParams`` for ``request`` (its own resolution and validation of the asks)."""
    refused: Optional[Tuple[str, str]] = None
    for attr, field, unset, why in _REFUSED:
        if getattr(params, attr) not in (unset, None):
            refused = (field, why)
            break
    guided_by_tools = getattr(request, "tool_choice", None) not in (None, "none", "auto")
    if refused is not None and refused[0] == "response_format" and guided_by_tools:
        refused = ("tool_choice", refused[1])  # the tool parser asked for it: a required or named tool
    if refused is None and params.logprobs:
        refused = ("top_logprobs", "the engine returns the sampled token's log-prob only")
    return SamplingAsk(
        max_tokens=int(params.max_tokens),
        n=int(params.n),
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop_token_ids=tuple(params.stop_token_ids or ()),
        logprobs=params.logprobs,
        refused=refused,
    )


@dataclass(frozen=True)
class RenderedChat:
    """A chat request, rendered. ``request``: vLLM's validated ``ChatCompletionRequest`` (after the tool parser's
    ``adjust_request``); ``prompt_ids``: the prompt the engine is given; ``conversation``: the messages as the
    template saw them."""

    request: Any
    prompt_ids: Tuple[int, ...]
    conversation: List[Dict[str, Any]]
    sampling: SamplingAsk


@dataclass(frozen=True)
class RenderedCompletion:
    """A completion request, rendered: one prompt per entry of ``prompt_ids`` (a request may hold several), each
    with its own ``sampling`` (its ``max_tokens`` depends on its length)."""

    request: Any
    prompt_ids: Tuple[Tuple[int, ...], ...]
    sampling: Tuple[SamplingAsk, ...]


class OpenAIRenderer:
    """vLLM's OpenAI request rendering and response derendering for one local HF model directory, with no engine.

    Construction builds vLLM's ``ModelConfig`` / ``VllmConfig``, the renderer (the tokenizer and chat template) and
    the online renderer / derenderer, as vLLM's render server does (``launchers/render``): it reads the config and
    tokenizer files, loads no weights, starts no process and touches no device.

    Args:
        model_path: A local Hugging Face model directory.
        tool_parser: A vLLM tool-call parser name (``"hermes"``, ...); ``None``: tools are rendered into the prompt
            but calls are not parsed, and ``tool_choice="auto"`` is refused (vLLM's rule).
        chat_template: A template (text or file path) used instead of the tokenizer's.
        served_model_name: The ``model`` of every response; default ``model_path``.
        max_model_len: The engine's context length (:class:`rlhf.rollout.vllm.engine.VLLMSpec`); default the
            model's.
        reasoning_parser: A vLLM reasoning parser name, or ``None``.

    The ``*_async`` methods are for an event loop (an HTTP server); the plain ones run them on a private loop.
    """

    def __init__(
        self,
        model_path: str,
        tool_parser: Optional[str] = None,
        chat_template: Optional[str] = None,
        served_model_name: Optional[str] = None,
        max_model_len: Optional[int] = None,
        reasoning_parser: Optional[str] = None,
    ) -> None:
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_derenderer import OnlineDerenderer
        from vllm.renderers.online_renderer import OnlineRenderer

        self.served_model_name = served_model_name or model_path
        context: Dict[str, Any] = {} if max_model_len is None else {"max_model_len": max_model_len}
        args = EngineArgs(model=model_path, reasoning_parser=reasoning_parser or "", **context)
        model_config = args.create_model_config()
        # as vLLM's render server: no kernels run here, so a quantized checkpoint must not be validated for them
        model_config.quantization = None
        vllm_config = VllmConfig(
            model_config=model_config, structured_outputs_config=args.create_structured_outputs_config()
        )
        self.model_config = model_config
        renderer = renderer_from_config(vllm_config)
        #: the template text requests are rendered with; None: the tokenizer's own (its ``chat_template``)
        self.chat_template: Optional[str] = load_chat_template(chat_template)
        options: Dict[str, Any] = dict(
            request_logger=None,
            chat_template=self.chat_template,
            chat_template_content_format="auto",
            # a configured tool parser parses `tool_choice="auto"` calls (vLLM's --enable-auto-tool-choice)
            enable_auto_tools=tool_parser is not None,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
        )
        self._renderer = OnlineRenderer(model_config, renderer, **options)
        self._renderer.warmup()
        self._derenderer = OnlineDerenderer(model_config, renderer, **options)
        self.tokenizer = renderer.get_tokenizer()
        # the ids that end a response without being part of its text (vLLM's detokenizer drops a stop token)
        eos = model_config.try_get_generation_config().get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = frozenset(int(i) for i in [*eos_ids, self.tokenizer.eos_token_id] if i is not None)

    # ------------------------------------------------------------------------------------------------- rendering

    def render_chat(self, body: Dict[str, Any]) -> RenderedChat:
        return asyncio.run(self.render_chat_async(body))

    async def render_chat_async(self, body: Dict[str, Any]) -> RenderedChat:
        """``body``: a ``/v1/chat/completions`` JSON body. Raises :class:`RenderError` for a bad request."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        try:
            request = ChatCompletionRequest.model_validate(body)
            _refuse_flags(request)
            rendered = await self._renderer.render_chat(request)
            if isinstance(rendered, ErrorResponse):
                raise RenderError(rendered)
            conversation, engine_inputs = rendered
            prompt_ids = _token_ids(engine_inputs[0])
            limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
            params = request.to_sampling_params(self._max_tokens(limit, len(prompt_ids)), {})
        except RenderError:
            raise
        except Exception as exc:  # vLLM's own mapping: validation -> 400, NotImplementedError -> 501, ...
            raise _as_render_error(exc) from exc
        return RenderedChat(request, prompt_ids, [dict(m) for m in conversation], _sampling_ask(request, params))

    def render_completion(self, body: Dict[str, Any]) -> RenderedCompletion:
        return asyncio.run(self.render_completion_async(body))

    async def render_completion_async(self, body: Dict[str, Any]) -> RenderedCompletion:
        """``body``: a ``/v1/completions`` JSON body; its ``prompt`` is text, token ids, or a list of either."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        try:
            request = CompletionRequest.model_validate(body)
            _refuse_flags(request)
            if request.prompt is None:
                raise _bad_request("`prompt` is required", "prompt")
            engine_inputs = await self._renderer.render_completion(request)
            if isinstance(engine_inputs, ErrorResponse):
                raise RenderError(engine_inputs)
            prompts = tuple(_token_ids(e) for e in engine_inputs)
            asks = tuple(
                _sampling_ask(request, request.to_sampling_params(self._max_tokens(request.max_tokens, len(p)), {}))
                for p in prompts
            )
        except RenderError:
            raise
        except Exception as exc:
            raise _as_render_error(exc) from exc
        return RenderedCompletion(request, prompts, asks)

    def _max_tokens(self, asked: Optional[int], prompt_len: int) -> int:
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

        return get_max_tokens(self.model_config.max_model_len, asked, prompt_len, {})

    # ----------------------------------------------------------------------------------------------- derendering

    def chat_response(
        self,
        rendered: RenderedChat,
        generations: Sequence[Generation],
        request_id: str,
        created: int,
        stop_token_ids: Sequence[int] = (),
    ) -> Dict[str, Any]:
        return asyncio.run(self.chat_response_async(rendered, generations, request_id, created, stop_token_ids))

    async def chat_response_async(
        self,
        rendered: RenderedChat,
        generations: Sequence[Generation],
        request_id: str,
        created: int,
        stop_token_ids: Sequence[int] = (),
    ) -> Dict[str, Any]:
        """The ``chat.completion`` JSON for ``generations`` (choice ``i`` is ``generations[i]``, sampled from
        ``rendered.prompt_ids``). ``stop_token_ids``: the engine's stop ids besides EOS (``SamplingSpec``).

        Text, tool calls and reasoning are vLLM's derenderer's. ``logprobs`` (when asked) and, with
        ``return_token_ids``, the choice's ``token_ids`` cover every sampled token, the final EOS included, as
        vLLM's server returns them; the text leaves that stop token out, as vLLM's detokenizer does.
        """
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse, ChatMessage
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        request, prompt = rendered.request, list(rendered.prompt_ids)
        stops = frozenset(rendered.sampling.stop_token_ids) | frozenset(stop_token_ids)
        choices: List[Any] = []
        for index, gen in enumerate(generations):
            _check_prompt(gen, rendered.prompt_ids, index)
            tokens = _generate_response(
                gen, index, self.eos_token_ids, stops, with_logprobs=bool(request.logprobs), request_id=request_id
            )
            text_ids = tokens.choices[0].token_ids
            if not text_ids:  # the response is its stop token alone: derender it for its log-prob, show no text
                tokens.choices[0].token_ids = list(gen.response_ids)
            (choice,) = await self._derenderer.derender_chat(tokens, request, prompt)
            if not text_ids:
                choice.message = ChatMessage(role="assistant", content="")
            choice.token_ids = list(gen.response_ids) if request.return_token_ids else None
            choices.append(_as_served(choice, request))
        completion_tokens = sum(len(g.response_ids) for g in generations)
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.served_model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=len(prompt),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt) + completion_tokens,
            ),
            prompt_token_ids=prompt if request.return_token_ids else None,
        )
        return response.model_dump(mode="json")

    def completion_response(
        self,
        rendered: RenderedCompletion,
        generations: Sequence[Sequence[Generation]],
        request_id: str,
        created: int,
        stop_token_ids: Sequence[int] = (),
    ) -> Dict[str, Any]:
        return asyncio.run(self.completion_response_async(rendered, generations, request_id, created, stop_token_ids))

    async def completion_response_async(
        self,
        rendered: RenderedCompletion,
        generations: Sequence[Sequence[Generation]],
        request_id: str,
        created: int,
        stop_token_ids: Sequence[int] = (),
    ) -> Dict[str, Any]:
        """The ``text_completion`` JSON: ``generations[p]`` holds prompt ``p``'s samples; choices run prompt by
        prompt, as vLLM numbers them. Text, log-probs and token ids as :meth:`chat_response_async`."""
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        request = rendered.request
        if len(generations) != len(rendered.prompt_ids):
            raise ValueError(f"{len(generations)} lists of generations for {len(rendered.prompt_ids)} prompts")
        choices: List[Any] = []
        for p, (prompt, ask) in enumerate(zip(rendered.prompt_ids, rendered.sampling)):
            stops = frozenset(ask.stop_token_ids) | frozenset(stop_token_ids)
            for gen in generations[p]:
                index = len(choices)
                _check_prompt(gen, prompt, index)
                tokens = _generate_response(
                    gen,
                    index,
                    self.eos_token_ids,
                    stops,
                    with_logprobs=request.logprobs is not None,
                    request_id=request_id,
                )
                text_ids = tokens.choices[0].token_ids
                if not text_ids:
                    tokens.choices[0].token_ids = list(gen.response_ids)
                (choice,), _, _ = await self._derenderer.derender_completion(
                    [tokens], [len(prompt)], completion_request=request, prompt_token_ids=[list(prompt)]
                )
                choice.index = index
                if not text_ids:
                    choice.text = ""
                if request.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = list(prompt), list(gen.response_ids)
                choices.append(choice)
        prompt_tokens = sum(len(p) for p in rendered.prompt_ids)
        completion_tokens = sum(len(g.response_ids) for gens in generations for g in gens)
        response = CompletionResponse(
            id=request_id,
            created=created,
            model=self.served_model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
        return response.model_dump(mode="json")


def _token_ids(engine_input: Any) -> Tuple[int, ...]:
    """A rendered prompt's token ids (a decoder-only model's ``TokensInput``)."""
    return tuple(engine_input["prompt_token_ids"])


def _as_served(choice: Any, request: Any) -> Any:
    """What vLLM's coupled chat server does to a choice and its derenderer does not: ``parallel_tool_calls=false``
    keeps the first call, and calls parsed under ``tool_choice="auto"`` finish with ``"tool_calls"`` (OpenAI's)."""
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

    choice = maybe_filter_parallel_tool_calls(choice, request)
    if choice.message.tool_calls and request.tool_choice == "auto":
        choice.finish_reason = "tool_calls"
    return choice


def _check_prompt(gen: Generation, prompt_ids: Tuple[int, ...], index: int) -> None:
    # token in, token out: a response derendered against another prompt would train on the wrong context
    if tuple(gen.prompt_ids) != tuple(prompt_ids):
        raise ValueError(f"generation {index} was sampled from another prompt than the rendered request's")


def _generate_response(
    gen: Generation, index: int, eos: frozenset, stops: frozenset, with_logprobs: bool, request_id: str
) -> Any:
    """``gen`` as vLLM's token-out protocol (``GenerateTokensResponse``, what its generate server returns). The
    token ids are the text's: a final stop token is left out, as vLLM's detokenizer leaves it out of the text
    (``stop_reason``: that id when it is a stop id rather than EOS). The log-probs cover every sampled token."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs,
        GenerateLogProbsContent,
        GenerateTokensChoice,
        GenerateTokensResponse,
    )

    ids = list(gen.response_ids)
    stopped = gen.finish_reason == "stop" and bool(ids) and (ids[-1] in eos or ids[-1] in stops)
    text_ids = ids[:-1] if stopped else ids
    logprobs = None
    if with_logprobs:
        content = [GenerateLogProbsContent(token_id=t, logprob=lp) for t, lp in zip(ids, gen.response_logps)]
        logprobs = GenerateLogProbs(content=content)
    choice = GenerateTokensChoice(
        index=index,
        finish_reason=gen.finish_reason,
        stop_reason=ids[-1] if stopped and ids[-1] not in eos else None,
        token_ids=text_ids,
        logprobs=logprobs,
    )
    return GenerateTokensResponse(request_id=request_id, prompt_token_ids=list(gen.prompt_ids), choices=[choice])
