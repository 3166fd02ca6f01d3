"""The PRM server (reward_models.serve) under load, and server-side batching against scoring in-process.

    python bench/prm_server.py [--dataset math500|arith] [--clients 64] [--seconds 20]
                               [--solutions_per_request 4] [--torch_threads N] [--prm_dir DIR]

Trajectories: MATH-500 problems (``--data``, default the bundled envs/data/math500.jsonl) with their reference
solutions split into steps (``envs.prompts.split_steps``), each cut at a random step (seeded; finished
when the cut is the whole solution); ``--dataset arith``: Arith problems, short texts. A pool of
``clients x solutions_per_request`` of them is scored in-process first: the reference answers.

Load: the server runs as a subprocess (``python -m reward_models.serve --port 0 --kv_cache_mb 0``: no
cache hits on repeated texts). ``--clients`` threads, each with its own keep-alive connection, send
requests of ``--solutions_per_request`` random pool trajectories in a loop for ``--seconds`` (those in
flight then finish), each tagged with an id kept client-side, retrying 503s. Reported: requests/s,
solutions/s, steps/s, p50/p99 latency, the server's mean batch, and the requests lost (no 200
answer), duplicated (an id answered twice) and wrong (an answer not equal to its own trajectories'
in-process scores within 1e-4; every answer is checked).

The same work (the pool, cut into requests of ``--solutions_per_request``) scored four ways:
(a) in-process, one caller, one call with everything; (b) in-process, one call per request, in turn
(what the clients would do with a model each, sharing one device, or one model without a server);
(c) remote, one request per client, all clients at once; (d) remote, one client, one request at a time.

Where server-side batching wins: many small concurrent requests. The server scores them in one call,
length-sorted into the PRM's chunks, so (c) comes close to (a), which needs one caller holding all
the work; (b), the same small requests without a server, pays the per-call overhead (short Arith
texts) and pads each request to its longest trajectory (MATH-500's mixed lengths). On a GPU, where a
forward of 64 sequences costs about what one of 4 does, the gap to (b) should be far larger (not
measured yet). Where it does not: one client sending requests in turn ((d): each request waits
``max_wait_ms`` for company that never comes, and pays HTTP and JSON); a caller that already sends
large batches (the server only adds its overhead to (a)); and latency: the server adds throughput
only where the model has some to spare, so on a CPU with long texts 64 clients wait for the model
in turn (seconds each).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from envs.datasets import MATH500, Arith, load_problems
from envs.prompts import split_steps
from reward_models.prm import ProcessRewardModel

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Pool:
    """N trajectories: problem texts, step prefixes and whether each is the whole solution."""

    problems: list[str]
    steps: list[list[str]]
    finished: list[bool]

    def payload(self, indices) -> dict:
        return {"problems": [self.problems[i] for i in indices], "steps": [self.steps[i] for i in indices],
                "finished": [self.finished[i] for i in indices]}

    def num_steps(self, indices) -> int:
        return sum(len(self.steps[i]) for i in indices)


def build_pool(dataset: str, data: Path, size: int, seed: int) -> Pool:
    """``size`` trajectories, each a problem's reference solution cut after a random step."""
    if dataset == "math500":
        if not data.is_file():
            raise SystemExit(f"{data} not found: pass --data PATH to a MATH-500 JSONL file, or use --dataset arith")
        problems = [p for p in load_problems(data) if p.solution and split_steps(p.solution)]
    else:
        problems = Arith().problems(size, seed=seed)
    rng = np.random.default_rng(seed)
    pool = Pool([], [], [])
    for i in range(size):
        problem = problems[i % len(problems)]
        steps = split_steps(problem.solution)
        k = int(rng.integers(1, len(steps) + 1))
        pool.problems.append(problem.problem)
        pool.steps.append(steps[:k])
        pool.finished.append(k == len(steps))
    return pool


class Client:
    """One keep-alive connection to the server; ``post`` retries 503s and dropped connections."""

    def __init__(self, url: str, timeout: float = 900):
        parts = urllib.parse.urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)

    def call(self, method: str, path: str, payload: dict | None = None) -> tuple[int, dict, str | None]:
        body = None if payload is None else json.dumps(payload).encode()
        self.connection.request(method, path, body, {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        return response.status, json.loads(response.read()), response.getheader("Retry-After")

    def post(self, payload: dict, tries: int = 10) -> tuple[int, dict]:
        """(status, answer) of the first attempt that is not a 503 or a dropped connection, else the last."""
        last: tuple[int, dict] = (0, {"error": "not sent"})
        for _ in range(tries):
            try:
                status, answer, retry_after = self.call("POST", "/v1/score", payload)
            except (OSError, http.client.HTTPException) as error:
                self.connection.close()  # reopened by the next request
                last = (0, {"error": repr(error)})
                continue
            if status != 503:
                return status, answer
            last = (status, answer)
            time.sleep(float(retry_after or 1))
        return last


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """The server subprocess and its URL, read from its one printed line."""
    command = [sys.executable, "-m", "reward_models.serve", "--model", str(args.prm_dir), "--port", "0",
               "--device", args.device, "--kv_cache_mb", "0", "--max_batch", str(args.max_batch),
               "--max_wait_ms", str(args.max_wait_ms)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.torch_threads)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    ready, _, _ = select.select([process.stdout], [], [], 300)
    line = process.stdout.readline().decode() if ready else ""
    if not line.startswith("serving PRM"):
        process.kill()
        raise SystemExit(f"the server did not start (printed {line!r}, exit code {process.poll()}): {command}")
    return process, line.split()[-1]


def health(url: str) -> dict:
    return Client(url).call("GET", "/health")[1]


def is_right(answer: list[list[float]], indices, reference: list[np.ndarray]) -> bool:
    return len(answer) == len(indices) and all(
        len(have) == len(reference[i]) and np.allclose(have, reference[i], atol=1e-4, rtol=0)
        for have, i in zip(answer, indices))


@dataclass
class Record:
    """What a client keeps of one request."""

    request_id: str
    indices: list[int]
    status: int
    seconds: float
    answer: dict = field(repr=False)


def load_client(client: int, url: str, pool: Pool, args: argparse.Namespace, deadline: float,
                records: list[Record]) -> None:
    """Sends requests of random pool trajectories until ``deadline``, appending one record each."""
    rng = np.random.default_rng(args.seed + 1 + client)
    connection = Client(url)
    number = 0
    while time.monotonic() < deadline:
        indices = rng.choice(len(pool.problems), args.solutions_per_request, replace=False).tolist()
        start = time.perf_counter()
        status, answer = connection.post(pool.payload(indices))
        records.append(Record(f"{client}-{number}", indices, status, time.perf_counter() - start, answer))
        number += 1


def run_threads(target, arguments: list[tuple]) -> float:
    """Wall seconds of ``target(*a)`` for every ``a`` on its own thread, started together."""
    threads = [threading.Thread(target=target, args=a) for a in arguments]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def load_test(url: str, pool: Pool, reference: list[np.ndarray], args: argparse.Namespace) -> None:
    """Prints the load table: C clients sending requests in a loop for ``--seconds``."""
    before = health(url)
    per_client: list[list[Record]] = [[] for _ in range(args.clients)]
    deadline = time.monotonic() + args.seconds
    wall = run_threads(load_client, [(c, url, pool, args, deadline, per_client[c]) for c in range(args.clients)])
    after = health(url)
    records = [r for rs in per_client for r in rs]
    answered = [r for r in records if r.status == 200]
    ids = [r.request_id for r in answered]
    wrong = sum(not is_right(r.answer["step_scores"], r.indices, reference) for r in answered)
    latencies = np.array([r.seconds for r in answered]) * 1000
    solutions = sum(len(r.indices) for r in answered)
    batches = after["batches"] - before["batches"]
    print(f"\nLoad: {args.clients} clients x {args.solutions_per_request} solutions/request for {args.seconds:g} s "
          f"(wall {wall:.1f} s with the requests in flight at the end)\n")
    print("| requests | requests/s | solutions/s | steps/s | p50 ms | p99 ms | mean batch | lost | duplicated "
          "| wrong |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(answered)} | {len(answered) / wall:.1f} | {solutions / wall:.1f} | "
          f"{sum(pool.num_steps(r.indices) for r in answered) / wall:.1f} | "
          f"{np.percentile(latencies, 50):.0f} | {np.percentile(latencies, 99):.0f} | "
          f"{(after['solutions'] - before['solutions']) / max(batches, 1):.1f} | {len(records) - len(answered)} | "
          f"{len(ids) - len(set(ids))} | {wrong} |")
    for record in [r for r in records if r.status != 200][:3]:
        print(f"lost {record.request_id}: {record.status} {record.answer}")


def remote_same_work(url: str, requests: list[list[int]], pool: Pool, reference: list[np.ndarray],
                     clients: int) -> tuple[float, int, int]:
    """(seconds, server batches, wrong answers) of ``requests`` sent by ``clients`` threads (round-robin)."""
    before = health(url)
    answers: list[tuple[list[int], int, dict]] = []

    def send(share: list[list[int]]) -> None:
        connection = Client(url)
        for indices in share:
            answers.append((indices, *connection.post(pool.payload(indices))))

    seconds = run_threads(send, [(requests[c::clients],) for c in range(clients)])
    wrong = sum(status != 200 or not is_right(answer["step_scores"], indices, reference)
                for indices, status, answer in answers)
    return seconds, health(url)["batches"] - before["batches"], wrong + len(requests) - len(answers)


def print_comparison(rows: list[tuple[str, int, float]], pool: Pool, args: argparse.Namespace) -> None:
    solutions, steps = len(pool.problems), pool.num_steps(range(len(pool.problems)))
    print(f"\nThe same work: {solutions} {args.dataset} trajectories ({steps} steps) in requests of "
          f"{args.solutions_per_request}\n")
    print("| way | model calls | seconds | solutions/s | steps/s | vs (a) |")
    print("|---|---:|---:|---:|---:|---:|")
    for way, calls, seconds in rows:
        print(f"| {way} | {calls} | {seconds:.2f} | {solutions / seconds:.1f} | {steps / seconds:.1f} | "
              f"{rows[0][2] / seconds:.2f}x |")


def compare(url: str, prm: ProcessRewardModel, pool: Pool, reference: list[np.ndarray], seconds_a: float,
            args: argparse.Namespace) -> None:
    """Prints the four ways of scoring the pool (see the module docstring)."""
    n = args.solutions_per_request
    requests = [list(range(i, min(i + n, len(pool.problems)))) for i in range(0, len(pool.problems), n)]
    start = time.perf_counter()
    for indices in requests:
        prm.step_scores(**pool.payload(indices))
    seconds_b = time.perf_counter() - start
    seconds_c, batches_c, wrong_c = remote_same_work(url, requests, pool, reference, args.clients)
    seconds_d, batches_d, wrong_d = remote_same_work(url, requests, pool, reference, 1)
    if wrong_c or wrong_d:
        print(f"WRONG remote answers: {wrong_c} with {args.clients} clients, {wrong_d} with one")
    print_comparison([("(a) in-process, one call", 1, seconds_a),
                      ("(b) in-process, one call per request", len(requests), seconds_b),
                      (f"(c) remote, {args.clients} concurrent clients", batches_c, seconds_c),
                      ("(d) remote, 1 client, one request at a time", batches_d, seconds_d)], pool, args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("math500", "arith"), default="math500")
    parser.add_argument("--data", type=Path, default=MATH500, help="MATH-500 JSONL (--dataset math500)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the load test sends requests")
    parser.add_argument("--solutions_per_request", type=int, default=4)
    parser.add_argument("--prm_dir", default=None, help="a Math-Shepherd PRM directory (default: the tiny PRM)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--torch_threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads in-process and in the server (default: half the cores; the other half "
                             "runs the clients, HTTP and JSON)")
    parser.add_argument("--max_batch", type=int, default=64)
    parser.add_argument("--max_wait_ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.prm_dir is None:
        from models.tiny import shipped_models

        args.prm_dir = shipped_models(team=False).prm
    torch.set_num_threads(args.torch_threads)
    pool = build_pool(args.dataset, args.data, args.clients * args.solutions_per_request, args.seed)
    prm = ProcessRewardModel(args.prm_dir, device=args.device, kv_cache_mb=0)
    prm.step_scores(**pool.payload(range(8)))  # warm-up
    start = time.perf_counter()
    reference = prm.step_scores(**pool.payload(range(len(pool.problems))))  # (a), and the reference answers
    seconds_a = time.perf_counter() - start
    process, url = start_server(args)
    try:
        print(f"PRM {args.prm_dir} on {args.device}, {args.torch_threads} torch thread(s), server {url} "
              f"(max_batch {args.max_batch}, max_wait_ms {args.max_wait_ms:g}), {args.dataset}: "
              f"{statistics.mean(len(s) for s in pool.steps):.1f} steps per trajectory")
        compare(url, prm, pool, reference, seconds_a, args)
        load_test(url, pool, reference, args)
    finally:
        process.send_signal(signal.SIGTERM)
        print(f"\nserver exit code {process.wait(timeout=60)}")


if __name__ == "__main__":
    main()
