"""The checks of scripts/compose_check.sh, run from the host against the published gateway
(http://127.0.0.1:8000) and the node containers' own addresses on the compose bridge. Each step
exits non-zero, saying why, when its check fails; each prints one JSON line of what it saw.

compose_probe.py wait --prefill N --decode M      /health counts N prefill and M decode nodes
compose_probe.py chat [--expect-prefill N] [--expect-decode M]
                                                   concurrent chats through the openai client,
                                                   streaming and not; at least N and M distinct
                                                   nodes of each phase served them
compose_probe.py greedy                            greedy chat == `pdserve generate --chat`
compose_probe.py metrics --save F | --moved-since F  ID...
                                                   every container's :9100/metrics answers; with
                                                   --moved-since, its counters grew since --save
compose_probe.py load -- COMMAND...                light load; COMMAND runs under it (a docker
                                                   kill, a scale-down); no request may fail
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

BASE_URL = "http://127.0.0.1:8000"
GREEDY_PROMPT = "Name three colors of the rainbow."
GREEDY_TOKENS = 24


def client() -> OpenAI:
    return OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0, timeout=120)


@functools.cache
def served_model() -> str:
    return client().models.list().data[0].id


def num_nodes() -> dict[str, int]:
    try:
        with urllib.request.urlopen(f"{BASE_URL}/health", timeout=3) as response:
            return json.load(response).get("num_nodes", {})
    except OSError:
        return {}


def wait(args) -> None:
    want = {"prefill": args.prefill, "decode": args.decode}
    deadline, seen = time.monotonic() + args.timeout_s, {}
    while time.monotonic() < deadline:
        seen = num_nodes()
        if all(seen.get(role, 0) == count for role, count in want.items()):
            return report("wait", nodes=seen, waited_s=round(args.timeout_s - (deadline - time.monotonic()), 1))
        time.sleep(2)
    fail(f"after {args.timeout_s:.0f} s the gateway counts {seen}, not {want}")


def one_chat(i: int, stream: bool, max_tokens: int = 8) -> dict[str, str]:
    """One chat; returns its route (`x-pdserve-route` parsed) or raises."""
    messages = [{"role": "user", "content": f"Request {i}: count to {i % 9 + 3}."}]
    if stream:
        with client().chat.completions.with_streaming_response.create(
            model=served_model(), messages=messages, max_tokens=max_tokens, stream=True
        ) as response:
            route = response.headers["x-pdserve-route"]
            chunks = list(response.parse())
        if not any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks):
            raise AssertionError(f"stream {i} had no content")
    else:
        raw = client().chat.completions.with_raw_response.create(
            model=served_model(), messages=messages, max_tokens=max_tokens
        )
        route = raw.headers["x-pdserve-route"]
        if not raw.parse().choices[0].message.content:
            raise AssertionError(f"chat {i} had no content")
    return dict(part.split("=", 1) for part in route.split("; "))


def chat(args) -> None:
    # Concurrent: the router breaks load ties by node id, so one-at-a-time requests all land on one node.
    with ThreadPoolExecutor(args.concurrency) as pool:
        routes = list(pool.map(lambda i: one_chat(i, stream=i % 2 == 0), range(args.requests)))
    used = {role: sorted({route[role] for route in routes}) for role in ("prefill", "decode")}
    report("chat", requests=args.requests, nodes_used=used)
    if len(used["prefill"]) < args.expect_prefill or len(used["decode"]) < args.expect_decode:
        fail(f"expected >= {args.expect_prefill} prefill and >= {args.expect_decode} decode nodes used: {used}")


def greedy(args) -> None:
    response = client().chat.completions.create(
        model=served_model(),
        messages=[{"role": "user", "content": GREEDY_PROMPT}],
        max_tokens=GREEDY_TOKENS,
        temperature=0,
    )
    served = response.choices[0].message.content
    command = [args.pdserve, "generate", "--chat", "--temperature", "0", "--max-tokens", str(GREEDY_TOKENS)]
    offline = json.loads(subprocess.run([*command, GREEDY_PROMPT], check=True, capture_output=True).stdout)["text"]
    report("greedy", served=served, offline=offline)
    if served != offline:
        fail("the served greedy text differs from `pdserve generate`")


def scrape(container: str) -> dict[str, float]:
    """The container's counters (`_total`) and histogram counts (`_count`), scraped over the bridge."""
    address = subprocess.run(
        ["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", container],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    with urllib.request.urlopen(f"http://{address}:9100/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if not line.startswith("#") and name.split("{")[0].endswith(("_total", "_count")):
            samples[name] = float(value)
    return samples


def metrics(args) -> None:
    scraped = {container: scrape(container) for container in args.containers}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(scraped, f)
        return report("metrics", scraped={c[:12]: len(s) for c, s in scraped.items()})
    with open(args.moved_since) as f:
        before = json.load(f)
    moved = {
        c[:12]: sum(value - before.get(c, {}).get(name, 0.0) for name, value in samples.items())
        for c, samples in scraped.items()
    }
    report("metrics", counters_moved_by=moved)
    if not all(amount > 0 for amount in moved.values()):
        fail(f"some node's counters did not move: {moved}")


def load(args) -> None:
    """Light load from `concurrency` threads; COMMAND runs after --before-s; the load goes on for
    --after-s more. Every request must succeed."""
    stop, results, lock = threading.Event(), [], threading.Lock()

    def worker(w: int) -> None:
        i = w
        while not stop.is_set():
            started = time.monotonic()
            try:
                decode, outcome = one_chat(i, stream=True, max_tokens=16)["decode"], None
            except Exception as error:  # every failure is reported below
                decode, outcome = "", repr(error)
            with lock:
                results.append((started, time.monotonic() - started, outcome, decode))
            i += args.concurrency

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(args.before_s)
    command_at = time.monotonic()
    subprocess.run(args.command, check=True)
    command_took_s = time.monotonic() - command_at
    time.sleep(args.after_s)
    stop.set()
    for thread in threads:
        thread.join()
    failures = [outcome for _, _, outcome, _ in results if outcome]
    after = [latency for started, latency, _, _ in results if started >= command_at]
    # [seconds from the command, latency, decode node]: which requests waited, and where they ran.
    timeline = [[round(s - command_at, 1), round(latency, 1), decode[:20]] for s, latency, _, decode in results]
    report(
        "load",
        command=" ".join(args.command),
        requests=len(results),
        failed=len(failures),
        started_after_command=len(after),
        slowest_after_command_s=round(max(after, default=0.0), 2),
        command_took_s=round(command_took_s, 1),
        timeline=timeline,
    )
    if failures or not after:
        fail(f"{len(failures)} requests failed: {failures[:3]}" if failures else "no request ran after the command")


def report(step: str, **seen) -> None:
    print(json.dumps({"step": step, **seen}), flush=True)


def fail(why: str) -> None:
    print(f"compose_probe: FAILED: {why}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    steps = parser.add_subparsers(dest="step", required=True)
    step = steps.add_parser("wait")
    step.add_argument("--prefill", type=int, required=True)
    step.add_argument("--decode", type=int, required=True)
    step.add_argument("--timeout-s", type=float, default=300)
    step = steps.add_parser("chat")
    step.add_argument("--requests", type=int, default=24)
    step.add_argument("--concurrency", type=int, default=8)
    step.add_argument("--expect-prefill", type=int, default=1)
    step.add_argument("--expect-decode", type=int, default=1)
    step = steps.add_parser("greedy")
    step.add_argument("--pdserve", default=".venv/bin/pdserve")
    step = steps.add_parser("metrics")
    step.add_argument("containers", nargs="+")
    saved = step.add_mutually_exclusive_group(required=True)
    saved.add_argument("--save")
    saved.add_argument("--moved-since")
    step = steps.add_parser("load")
    step.add_argument("--concurrency", type=int, default=2)
    step.add_argument("--before-s", type=float, default=3)
    step.add_argument("--after-s", type=float, default=10)
    step.add_argument("command", nargs="+")
    args = parser.parse_args()
    {"wait": wait, "chat": chat, "greedy": greedy, "metrics": metrics, "load": load}[args.step](args)


if __name__ == "__main__":
    main()
