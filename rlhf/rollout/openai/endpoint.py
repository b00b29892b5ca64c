"""An OpenAI-compatible endpoint over the rollout engines, for agent code during an RL step.

Each episode gets a base URL of its own, ``http://HOST:PORT/episodes/<key>/v1``, which an ``openai`` client takes
as ``base_url``; ``/chat/completions``, ``/completions`` and ``/models`` are served under it, ``stream=true``
included (the whole reply in one chunk, :mod:`rlhf.rollout.openai.stream`). Requests are rendered
and replies derendered by vLLM's own OpenAI serving code (:class:`rlhf.rollout.openai.render.OpenAIRenderer`: chat
templates, ``tools``, tool-call parsers), and sampled by the project's engines (any
:class:`~rlhf.rollout.backend.RolloutBackend`), so the weights an agent talks to are the policy's of this step,
its sampling is the trainer's (``rollout.temperature`` / ``top_p`` / ``top_k``: the log-probs trained against must
be of the distribution sampled; what the request asks for instead is ignored), every reply stops on EOS and the
end of turn of the template requests are rendered with, and every token is recorded
(:mod:`rlhf.rollout.transcripts`: the episode is trained on the tokens sampled, never on re-tokenised text).

Server library: FastAPI on uvicorn, vLLM's own HTTP stack (both installed with it), in a thread of the driver
process: the agents run in the environment actors and reach it over HTTP; the driver's thread calls the engines.
Concurrent requests are batched: a batcher thread takes every request waiting and sends them to the engines in
one ``generate_each`` call (continuous batching at the call level; vLLM batches within the call). Request ``r`` of
an episode is sampled with seed ``episode seed + r`` whichever batch it lands in, so an episode's tokens do not
depend on the other agents' timing.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from rlhf.data.chat import ChatFormatter, ChatTemplateError
from rlhf.rollout.openai.stream import chat_chunks, completion_chunks, events, take_stream
from rlhf.rollout.transcripts import EpisodeTranscript, Exchange, normalise
from rlhf.rollout.types import Generation, SamplingSpec
from rlhf.utils.log import get_logger

log = get_logger(__name__)

GenerateEach = Callable[[Sequence[Sequence[int]], Sequence[SamplingSpec]], List[Generation]]


class Batcher:
    """Requests from any thread or event loop, sent to ``generate_each`` in batches by one thread: each call takes
    every request waiting when the previous call returned."""

    def __init__(self, generate_each: GenerateEach) -> None:
        self.generate_each = generate_each
        self.pending: "queue.Queue[Optional[Tuple[Tuple[int, ...], SamplingSpec, concurrent.futures.Future]]]"
        self.pending = queue.Queue()
        self.calls, self.requests = 0, 0
        self.seconds = 0.0  # inside generate_each, summed over calls
        self.thread = threading.Thread(target=self._loop, name="rlhf-endpoint-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingSpec) -> "concurrent.futures.Future[Generation]":
        future: "concurrent.futures.Future[Generation]" = concurrent.futures.Future()
        self.pending.put((tuple(prompt_ids), sampling, future))
        return future

    def _loop(self) -> None:
        while True:
            first = self.pending.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    item = self.pending.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.pending.put(None)  # stop after this batch
                    break
                batch.append(item)
            self.calls, self.requests = self.calls + 1, self.requests + len(batch)
            started = time.perf_counter()
            try:
                generations = self.generate_each([b[0] for b in batch], [b[1] for b in batch])
            except BaseException as e:  # every request of the batch fails with the engines' error
                for _, _, future in batch:
                    future.set_exception(e)
                continue
            finally:
                self.seconds += time.perf_counter() - started
            for (_, _, future), generation in zip(batch, generations):
                future.set_result(generation)

    def close(self) -> None:
        self.pending.put(None)
        self.thread.join(timeout=30)


class BusyClock:
    """Wall seconds during which at least one request was in flight: the union of the requests' intervals.

    Why not the sum of each request's seconds: the endpoint serves an episode's agents all at once, so 64 requests
    of 2 s each in flight together are 2 s of the step, not 128. The union is the endpoint's share of the step's
    wall time (gaps while no agent is talking to it, e.g. an agent's own tool calls, are not counted); the sum over
    requests divided by it is the mean number of requests in flight. ``clock``: seconds, monotonic (tests pass a
    fake one). Entered and left from the server's event loop, read from the driver's thread: under a lock."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.active = 0  # requests in flight
        self.since = 0.0  # when the current busy span began (active > 0)
        self.closed = 0.0  # seconds of the busy spans that have ended
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """One request in flight for the duration of the ``with`` block."""
        with self.lock:
            if self.active == 0:
                self.since = self.clock()
            self.active += 1
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1
                if self.active == 0:
                    self.closed += self.clock() - self.since

    def seconds(self) -> float:
        """Busy seconds so far, the span still open (a request in flight) counted up to now."""
        with self.lock:
            return self.closed + (self.clock() - self.since if self.active else 0.0)


@dataclass
class Session:
    """One episode's state on the endpoint: its seed base, token budget and transcript."""

    transcript: EpisodeTranscript
    seed: Optional[int]
    budget: int  # tokens the episode may hold in all (rollout.max_episode_tokens)
    max_requests: Optional[int] = None  # requests the episode may make (rollout.max_turns); None: no limit
    exhausted: bool = False  # a request found no room left: the episode ended at the token budget
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # an episode's requests are a chain: one at a time


@dataclass
class EndpointStats:
    """Counts and seconds summed over the requests answered (the seconds of refused requests are not counted).
    Summed over concurrent requests, so more than the wall time they took: that is :class:`BusyClock`'s."""

    requests: int = 0
    refused: int = 0  # requests answered with an error (bad request, unknown episode)
    seconds: float = 0.0  # from the body parsed to the response made: the sum of the parts below and bookkeeping
    render_seconds: float = 0.0  # vLLM's render: validation, chat template, tokenization
    chain_seconds: float = 0.0  # a chat request's prompt from the transcript (renders the new messages again)
    generate_seconds: float = 0.0  # waiting for the engines: the queue to the batcher and its generate_each call
    derender_seconds: float = 0.0  # vLLM's derender: detokenization, tool-call parsing, the response object


class AgentEndpoint:
    """The HTTP endpoint (see the module docstring). Start with :meth:`start`, give each episode the URL of
    :meth:`open`, take its transcript back with :meth:`close`.

    Args:
        renderer: an :class:`~rlhf.rollout.openai.render.OpenAIRenderer` of the policy's model.
        generate_each: the engines' ``generate_each``.
        sampling: the trainer's sampling (temperature, top-p/k, ``max_new_tokens``: each request's cap; its seed is
            replaced per request, its stop ids by the endpoint's own, :attr:`stop_token_ids`).
        host: the address to listen on and to hand out (the driver node's address for agents on other nodes).
    """

    def __init__(self, renderer, generate_each: GenerateEach, sampling: SamplingSpec, host: str = "127.0.0.1"):
        self.renderer, self.sampling, self.host = renderer, sampling, host
        self.batcher = Batcher(generate_each)
        self.sessions: Dict[str, Session] = {}
        self.stats = EndpointStats()
        self.busy = BusyClock()  # wall seconds with a request in flight (stats.seconds sums over requests)
        self.port = 0
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None
        self.close_ids = _close_ids(renderer)
        self.stop_token_ids = _stop_ids(renderer)  # every reply's: EOS and the template's end of turn

    # ------------------------------------------------------------------------------------------ life cycle
    def start(self, port: int = 0, timeout_s: float = 30.0) -> "AgentEndpoint":
        import uvicorn  # the server library: imported by the run that serves agents only

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(_app(self), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="rlhf-endpoint", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=30)
            self._server = None
        self.batcher.close()

    def shutdown(self) -> None:
        """:meth:`stop`, by the name a run stops its worker groups with (the endpoint is stopped with them)."""
        self.stop()

    def __enter__(self) -> "AgentEndpoint":
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ episodes
    def open(self, index: int, seed: Optional[int], budget: int, max_requests: Optional[int] = None) -> str:
        """A new episode ``index`` (named in errors), sampled from ``seed`` (request ``r`` with ``seed + r``), within
        ``budget`` tokens and ``max_requests`` requests; returns its base URL."""
        key = f"{index}-{secrets.token_hex(4)}"
        self.sessions[key] = Session(EpisodeTranscript(index), seed, budget, max_requests)
        return f"http://{self.host}:{self.port}/episodes/{key}/v1"

    def close(self, base_url: str) -> Session:
        """The episode's session (its transcript); later requests to its URL get 404."""
        return self.sessions.pop(base_url.rstrip("/").split("/")[-2])

    # ------------------------------------------------------------------------------------------ requests
    async def chat(self, key: str, body: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        """One ``/chat/completions`` request of episode ``key``: ``(HTTP status, JSON body)``."""
        started = time.perf_counter()
        session, rendered = await self._open_request(key, self.renderer.render_chat_async, body)
        if session is None:
            return rendered  # the refusal
        if rendered.sampling.n != 1:
            return self._refuse(400, "n must be 1: an episode is one conversation", "n")
        if rendered.sampling.refused is not None:  # an ask the engines cannot honour (stop strings, penalties, ...)
            param, why = rendered.sampling.refused
            return self._refuse(400, why, param)
        messages = [dict(m) for m in body.get("messages", [])]
        tools = body.get("tools")
        async with session.lock:
            return await self._chat(session, rendered, messages, tools, started)

    async def _chat(self, session: Session, rendered, messages, tools, started: float) -> Tuple[int, Dict[str, Any]]:
        if self._at_limit(session):
            return self._no_more(session, "messages")
        transcript = session.transcript
        loop = asyncio.get_running_loop()
        chained = time.perf_counter()
        prompt, continues = await loop.run_in_executor(
            None, transcript.prompt_for, messages, tools, rendered.prompt_ids, self._render_ids, self.close_ids
        )
        self.stats.chain_seconds += time.perf_counter() - chained
        request_no = len(transcript.exchanges)
        sampling = self._sampling(session, len(prompt), rendered.sampling.max_tokens)
        if sampling is None:
            return self._no_room(session, "messages")
        generation = await self._generate(prompt, sampling)
        engine_view = dataclasses.replace(rendered, prompt_ids=tuple(prompt))
        derendered = time.perf_counter()
        response = await self.renderer.chat_response_async(
            engine_view,
            [generation],
            f"chatcmpl-{transcript.index}-{request_no}",
            int(time.time()),
            sampling.stop_token_ids,
        )
        self.stats.derender_seconds += time.perf_counter() - derendered
        reply = normalise(response["choices"][0]["message"])
        self._record(transcript, prompt, generation, tuple(normalise(m) for m in messages), reply, continues, started)
        return 200, response

    async def completion(self, key: str, body: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        """One ``/completions`` request of episode ``key``: ``(HTTP status, JSON body)``.

        The agent keeps its own text or tokens: each request carries the whole sequence as ``prompt``, one prompt
        (text or token ids), ``n=1``. Its prompt ids go to the engine as they are rendered, and the request
        continues the episode's chain when they start with the last exchange's prompt ids and sampled response ids
        (:meth:`EpisodeTranscript.continues_ids`; the ids after them are the observation), else the chain breaks
        there, named. A text prompt is tokenized again by the renderer, so an agent that appends text to the text it
        got back drifts: the text leaves out the stop token the policy sampled (``<|im_end|>``, EOS), and tokens
        can merge differently across the boundary, so its prompt does not extend the sampled ids and the chain
        breaks. Send token ids instead (``prompt`` as a list of ids, as vLLM accepts it; ``return_token_ids: true``
        returns ``prompt_token_ids`` and each choice's ``token_ids``, the stop token included): the prompt
        ``prompt_token_ids + token_ids + the observation's ids`` continues the chain exactly."""
        started = time.perf_counter()
        session, rendered = await self._open_request(key, self.renderer.render_completion_async, body)
        if session is None:
            return rendered  # the refusal
        if len(rendered.prompt_ids) != 1:
            why = "prompt must be one prompt (text or token ids), not a list of prompts: an episode is one sequence"
            return self._refuse(400, why, "prompt")
        ask = rendered.sampling[0]
        if ask.n != 1:
            return self._refuse(400, "n must be 1: an episode is one sequence", "n")
        if ask.refused is not None:
            param, why = ask.refused
            return self._refuse(400, why, param)
        async with session.lock:
            return await self._completion(session, rendered, started)

    async def _completion(self, session: Session, rendered, started: float) -> Tuple[int, Dict[str, Any]]:
        if self._at_limit(session):
            return self._no_more(session, "prompt")
        transcript = session.transcript
        prompt = list(rendered.prompt_ids[0])
        continues = transcript.continues_ids(prompt)
        request_no = len(transcript.exchanges)
        sampling = self._sampling(session, len(prompt), rendered.sampling[0].max_tokens)
        if sampling is None:
            return self._no_room(session, "prompt")
        generation = await self._generate(prompt, sampling)
        derendered = time.perf_counter()
        response = await self.renderer.completion_response_async(
            rendered, [[generation]], f"cmpl-{transcript.index}-{request_no}", int(time.time()), sampling.stop_token_ids
        )
        self.stats.derender_seconds += time.perf_counter() - derendered
        self._record(transcript, prompt, generation, (), response["choices"][0]["text"], continues, started)
        return 200, response

    def _record(
        self, transcript: EpisodeTranscript, prompt, generation: Generation, messages, reply, continues, started
    ) -> None:
        """The request's exchange on its episode's transcript (the ids the engine got and sampled), and its count
        and time in :attr:`stats`."""
        transcript.add(
            Exchange(
                tuple(prompt),
                generation.response_ids,
                generation.response_logps,
                generation.finish_reason,
                messages,
                reply,
                continues,
            )
        )
        self.stats.requests += 1
        self.stats.seconds += time.perf_counter() - started

    def _sampling(self, session: Session, prompt_len: int, asked: int) -> Optional[SamplingSpec]:
        """The trainer's sampling for the episode's next request: at most ``asked`` new tokens, within the episode's
        budget, seeded ``seed + request number``, stopping on :attr:`stop_token_ids`; ``None`` when the budget leaves
        no room."""
        room = min(self.sampling.max_new_tokens, asked, session.budget - prompt_len)
        if room < 1:
            return None
        request_no = len(session.transcript.exchanges)
        seed = None if session.seed is None else session.seed + request_no
        return dataclasses.replace(self.sampling, max_new_tokens=room, seed=seed, stop_token_ids=self.stop_token_ids)

    async def _generate(self, prompt: Sequence[int], sampling: SamplingSpec) -> Generation:
        waited = time.perf_counter()
        generation = await asyncio.wrap_future(self.batcher.submit(prompt, sampling))
        self.stats.generate_seconds += time.perf_counter() - waited
        return generation

    async def _open_request(self, key: str, render, body: Dict[str, Any]) -> Tuple[Optional[Session], Any]:
        """Episode ``key``'s session and the request ``render``-ed, or ``(None, (status, refusal))`` for an unknown
        episode or a request vLLM's renderer refuses."""
        from rlhf.rollout.openai.render import RenderError  # imports vLLM's serving code when first used

        started = time.perf_counter()
        session = self.sessions.get(key)
        if session is None:
            return None, self._no_episode(key)
        try:
            rendered = await render(body)
        except RenderError as e:
            return None, self._refuse(e.status_code, e.to_dict())
        self.stats.render_seconds += time.perf_counter() - started
        return session, rendered

    @staticmethod
    def _at_limit(session: Session) -> bool:
        """Whether the episode has made all its requests (checked under its lock: a chain's requests, one at a
        time)."""
        return session.max_requests is not None and len(session.transcript.exchanges) >= session.max_requests

    def _no_more(self, session: Session, param: str) -> Tuple[int, Dict[str, Any]]:
        index, limit = session.transcript.index, session.max_requests
        return self._refuse(400, f"episode {index} has made its {limit} requests (rollout.max_turns)", param)

    def _no_room(self, session: Session, param: str) -> Tuple[int, Dict[str, Any]]:
        session.exhausted = True
        index, budget = session.transcript.index, session.budget
        return self._refuse(400, f"episode {index} has no room left in its {budget}-token budget", param)

    def _no_episode(self, key: str) -> Tuple[int, Dict[str, Any]]:
        return self._refuse(404, f"no open episode {key!r} (it ended, or the URL is not this step's)")

    def _render_ids(self, messages, tools, add_generation_prompt: bool) -> List[int]:
        body: Dict[str, Any] = {
            "model": self.renderer.served_model_name,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            body["tools"] = tools
        return list(self.renderer.render_chat(body).prompt_ids)

    def _refuse(self, status: int, message: Any, param: Optional[str] = None) -> Tuple[int, Dict[str, Any]]:
        self.stats.refused += 1
        if isinstance(message, dict):
            return status, message
        return status, {"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}}


def _close_ids(renderer) -> List[int]:
    """What the chat template writes after an assistant's text (ChatML: ``<|im_end|>`` ``\\n``), as token ids: the
    template requests are rendered with (``env.chat_template``, else the tokenizer's own)."""
    tokenizer = renderer.tokenizer
    probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    text = tokenizer.apply_chat_template(probe, tokenize=False, chat_template=renderer.chat_template)
    close = text[text.rindex("2") + 1 :]
    return list(tokenizer(close, add_special_tokens=False)["input_ids"]) if close else []


def _stop_ids(renderer) -> Tuple[int, ...]:
    """What every reply stops on: EOS, and the end of turn of the template requests are rendered with (ChatML:
    ``<|im_end|>``). Taken from that template, not from the run's prompt rows: the endpoint renders every chat
    request with it whatever the rows' format, so a policy that ends its turn must stop there; with EOS alone (text
    prompt rows) each reply ran on to ``rollout.max_new_tokens`` writing ``<|im_end|>`` again and again, and was
    trained that way."""
    eos = tuple(sorted(renderer.eos_token_ids))
    try:
        end_of_turn = ChatFormatter(renderer.tokenizer, template=renderer.chat_template).end_of_turn_ids()
    except ChatTemplateError:  # no template at all (completions only): EOS alone
        end_of_turn = ()
    return eos + tuple(t for t in end_of_turn if t not in eos)


def _app(endpoint: AgentEndpoint):
    # (no ``from __future__ import annotations`` in this module: FastAPI reads these handlers' annotations, and
    # strings naming the local imports below would not resolve)
    from fastapi import FastAPI, Request  # the server library: imported by the run that serves agents only
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="rlhf agent endpoint")

    async def serve(handler, chunks, key: str, request: Request) -> Response:
        with endpoint.busy.busy():  # from the request's arrival to its response made (agent/endpoint_s)
            try:
                body = await request.json()
            except ValueError:
                status, answer = endpoint._refuse(400, "the body is not JSON")
                return JSONResponse(answer, status_code=status)
            stream, include_usage = take_stream(body)  # served unstreamed, then sent as chunks (openai_stream.py)
            status, answer = await handler(key, body)
        if not stream or status != 200:  # an error is a plain JSON error, as OpenAI's server sends it
            return JSONResponse(answer, status_code=status)
        return StreamingResponse(events(chunks(answer, include_usage)), media_type="text/event-stream")

    @app.post("/episodes/{key}/v1/chat/completions")
    async def chat(key: str, request: Request) -> Response:
        return await serve(endpoint.chat, chat_chunks, key, request)

    @app.post("/episodes/{key}/v1/completions")
    async def completions(key: str, request: Request) -> Response:
        return await serve(endpoint.completion, completion_chunks, key, request)

    @app.get("/episodes/{key}/v1/models")
    async def models(key: str) -> JSONResponse:
        name = endpoint.renderer.served_model_name
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rlhf"}]})

    return app
