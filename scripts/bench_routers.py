"""The load generator of scripts/bench-routers.sh: a multi-tenant
shared-prefix workload (SYSTEMS long system prompts, USERS users each,
every request a streaming chat of a few tokens), sent CONCURRENCY at a time
in a shuffled order, through BASE_URL (a router, or a replica). Prints one
JSON line: requests, TTFT p50/p99 (to the first token of reasoning or
content), seconds, and the prefix cache's hit rate over the replicas'
/metrics (vLLM's names), measured as the change during the run.

    python bench_routers.py BASE_URL MODEL SYSTEMS USERS CONCURRENCY REPLICA_ROOT...
"""

import asyncio
import json
import random
import sys
import time

import httpx


def system_prompt(k):
    facts = " ".join(f"Fact {k}.{i}: the value of item {i} in ledger {k} is {(i * 37 + k * 11) % 997}." for i in range(40))
    return f"You are the assistant of tenant {k}. Answer from these facts only. {facts}"


def counters(roots):
    hits = queries = 0.0
    for root in roots:
        for line in httpx.get(f"{root}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total{"):
                hits += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_queries_total{"):
                queries += float(line.split()[-1])
    return hits, queries


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


async def one(http, base, model, k, u):
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system_prompt(k)}, {"role": "user", "content": f"User {u}: what is item {u}?"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    async with http.stream("POST", f"{base}/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            delta = choices[0]["delta"] if choices else {}
            if delta.get("content") or delta.get("reasoning"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("a stream without a token")
    return ttft


async def main(base, model, systems, users, conc, roots):
    work = [(k, u) for k in range(systems) for u in range(users)]
    random.Random(7).shuffle(work)
    h0, q0 = counters(roots)
    sem = asyncio.Semaphore(conc)
    ttfts = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:

        async def run(k, u):
            async with sem:
                ttfts.append(await one(http, base, model, k, u))

        await asyncio.gather(*(run(k, u) for k, u in work))
    seconds = time.perf_counter() - t0
    h1, q1 = counters(roots)
    hit_rate = (h1 - h0) / (q1 - q0) if q1 > q0 else None
    print(json.dumps({"requests": len(work), "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99), "seconds": seconds, "hit_rate": hit_rate}))


if __name__ == "__main__":
    a = sys.argv
    asyncio.run(main(a[1], a[2], int(a[3]), int(a[4]), int(a[5]), a[6:]))
