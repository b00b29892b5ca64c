"""Reward scoring benchmark: how long one rollout's rewards take when the reward is slow (an I/O-bound check, a
judge behind a network), serially in the driver vs a pool of Ray actors vs an HTTP service.

    python bench/bench_reward.py [--samples 64] [--ms 50] [--workers 1,2,4] [--chunk 8] [--http-batch 8]
                                 [--http-concurrency 1,4,8] [--repeats 3]

Prints (figures, not pass/fail) seconds per rollout and samples/s for:

* serial      :func:`rlhf.rewards.functions.compute_rewards` on the whole batch, in this process (today's path);
* pool xW     :class:`rlhf.rewards.pool.RewardPool` with W actors and ``--chunk`` samples per chunk;
* http cC     :class:`rlhf.rewards.remote.HttpReward` against a loopback ``ThreadingHTTPServer`` with up to C
              requests in flight of ``--http-batch`` samples.

Every reward sleeps ``--ms`` milliseconds per sample (the function; the server per sample of a request), so the
floor is ``samples * ms / parallelism``. Pools and servers are started before timing; each figure is the median of
``--repeats`` rollouts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, List

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REWARD = """
import time

def slow(prompts, responses):
    time.sleep({delay} * len(prompts))
    return [float(len(r)) for r in responses]
"""


def serve(delay: float) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay * len(payload["responses"]))
            body = json.dumps({"rewards": [float(len(r)) for r in payload["responses"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def timed(fn: Callable[[], Any], repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--ms", type=float, default=50.0, help="milliseconds the reward takes per sample")
    ap.add_argument("--workers", default="1,2,4", help="pool sizes to compare")
    ap.add_argument("--chunk", type=int, default=8, help="samples per pool chunk")
    ap.add_argument("--http-batch", type=int, default=8, help="samples per HTTP request")
    ap.add_argument("--http-concurrency", default="1,4,8", help="HTTP requests in flight to compare")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import ray

    from rlhf.rewards.functions import compute_rewards, parse_reward_specs
    from rlhf.rewards.pool import RewardPool
    from rlhf.rewards.remote import HttpReward

    delay = args.ms / 1000
    path = os.path.join(tempfile.mkdtemp(prefix="bench-reward-"), "slow_reward.py")
    with open(path, "w") as f:
        f.write(REWARD.format(delay=delay))
    spec = f"{path}:slow"
    prompts = [f"prompt {i}" for i in range(args.samples)]
    responses = ["x" * (i % 17) for i in range(args.samples)]
    rows: List[tuple] = []

    def row(mode: str, seconds: float) -> None:
        rows.append((mode, seconds))

    sources = parse_reward_specs([spec])
    want = compute_rewards(sources, prompts, responses)[0]
    row("serial", timed(lambda: compute_rewards(sources, prompts, responses), args.repeats))

    sizes = [int(x) for x in args.workers.split(",")]
    ray.init(address="local", num_cpus=max(sizes), include_dashboard=False, log_to_driver=False)
    for workers in sizes:
        with RewardPool([spec], workers, args.chunk, timeout_s=10 * delay, cpus_per_worker=1) as pool:
            assert bool((pool.score(prompts, responses).total == want).all())  # a warm-up that also checks
            row(f"pool x{workers}", timed(functools.partial(pool.score, prompts, responses), args.repeats))
    ray.shutdown()

    httpd = serve(delay)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    for concurrency in [int(x) for x in args.http_concurrency.split(",")]:
        reward = HttpReward(url, args.http_batch, 10 * delay, retries=0, concurrency=concurrency, trust_env=False)
        assert bool((reward.score(prompts, responses).total == want).all())
        row(f"http c{concurrency}", timed(functools.partial(reward.score, prompts, responses), args.repeats))
    httpd.shutdown()

    serial = rows[0][1]
    print(f"{args.samples} samples, reward {args.ms:g} ms/sample, pool chunks of {args.chunk}, "
          f"HTTP batches of {args.http_batch}; median of {args.repeats}")  # fmt: skip
    print(f"{'mode':<10} {'s/rollout':>10} {'samples/s':>10} {'vs serial':>10}")
    for mode, seconds in rows:
        print(f"{mode:<10} {seconds:>10.3f} {args.samples / seconds:>10.1f} {serial / seconds:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
