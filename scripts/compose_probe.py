"""Steps of scripts/compose_check.sh against the published gateway (http://127.0.0.1:8000). Not yet run.

compose_probe.py wait [--timeout-s S]       /health answers 200
compose_probe.py chat [--requests N]        chats (streaming and not) all succeed; prints the routes seen
"""

import argparse
import sys
import time
import urllib.request

from openai import OpenAI

BASE_URL = "http://127.0.0.1:8000"


def wait(timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{BASE_URL}/health", timeout=3).status == 200:
                return 0
        except OSError:
            pass
        time.sleep(2)
    return 1


def chat(num_requests: int) -> int:
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused")
    routes = set()
    for i in range(num_requests):
        messages = [{"role": "user", "content": f"Count to {i + 3}."}]
        raw = client.chat.completions.with_raw_response.create(model="", messages=messages, max_tokens=8)
        routes.add(raw.headers.get("x-pdserve-route"))
        assert raw.parse().choices[0].message.content is not None
        stream = client.chat.completions.create(model="", messages=messages, max_tokens=8, stream=True)
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)
    print("routes:", *sorted(map(str, routes)), sep="\n  ")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["wait", "chat"])
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--requests", type=int, default=12)
    args, _ = parser.parse_known_args()
    return wait(args.timeout_s) if args.step == "wait" else chat(args.requests)


if __name__ == "__main__":
    sys.exit(main())
