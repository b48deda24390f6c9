"""Tokens/s of `alignkit api` for 1 and for 8 concurrent clients: `python -m bench.api_clients`.

Starts `alignkit api` on a free loopback port (the bundled model unless `--model`), then for each client count
runs `--rounds` rounds in which every client sends one greedy request of `--max-tokens` tokens at once (the
openai client, one thread per client), and reports completion tokens per second of wall time, requests per
second and the mean latency. With 8 clients the server batches the waiting requests into shared decodes
(docs/api.md, "Batching"), so tokens/s should rise well above the single client's. Run it alone on the machine;
nothing here is a test assertion.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

PROMPTS = ["What is the capital of France?", "Name three fruits.", "Why is the sky blue?", "Count to ten.",
           "Translate to French: good morning.", "What is 12 plus 7?", "Write a haiku about the sea.",
           "What is a prime number?"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(base_url: str, process: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"alignkit api exited with status {process.returncode}")
        try:
            if httpx.get(f"{base_url}/models", timeout=2).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("alignkit api did not start in time")


def measure(base_url: str, model: str, clients: int, rounds: int, max_tokens: int) -> dict[str, float]:
    """Completion tokens/s, requests/s and mean latency of `rounds` rounds of `clients` simultaneous requests."""
    import openai

    tokens, latencies = [], []
    lock = threading.Lock()

    def ask(i: int) -> None:
        client = openai.OpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
        start = time.perf_counter()
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                               messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        with lock:
            latencies.append(time.perf_counter() - start)
            tokens.append(reply.usage.completion_tokens)

    start = time.perf_counter()
    for _ in range(rounds):
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    wall = time.perf_counter() - start
    return {"clients": clients, "tokens_per_second": sum(tokens) / wall, "requests_per_second": len(tokens) / wall,
            "mean_latency_s": statistics.mean(latencies), "completion_tokens": sum(tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="base model directory (default: the bundled model)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    port = _free_port()
    command = [sys.executable, "-m", "alignkit", "api", "--port", str(port), "--model-name", "bench"]
    if args.model:
        command += ["--model", args.model]
    env = {key: value for key, value in os.environ.items() if key != "ALIGNKIT_API_KEY"}
    process = subprocess.Popen(command, env=env)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_ready(base_url, process, timeout=600)
        measure(base_url, "bench", 1, 1, 8)  # warm-up: first-call costs out of the figures
        print(f"{'clients':>8} {'tokens/s':>10} {'requests/s':>11} {'latency s':>10}")
        for clients in args.clients:
            result = measure(base_url, "bench", clients, args.rounds, args.max_tokens)
            print(f"{clients:>8} {result['tokens_per_second']:>10.1f} {result['requests_per_second']:>11.2f} "
                  f"{result['mean_latency_s']:>10.2f}")
    finally:
        process.terminate()
        process.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
