"""The load generator of scripts/bench-serve.sh: N streaming completions at
a given concurrency against `m3c serve`, each timed token by token (one SSE
chunk per token). Prints one JSON line: output tok/s, TTFT and ITL
percentiles, and each stage's busy fraction over the run (from /metrics).

    python bench_serve.py BASE_URL MODEL CONCURRENCY REQUESTS MAX_TOKENS
"""

import asyncio
import json
import sys
import time

import httpx


def prompts(n):
    return [f"Request {i}: write about the number {i * 7} and why it matters." for i in range(n)]


def busy(root):
    out = {}
    for line in httpx.get(f"{root}/metrics", timeout=10).text.splitlines():
        if line.startswith("m3c:stage_busy_seconds_total{"):
            stage = line.split('stage="')[1].split('"')[0]
            out[stage] = float(line.split()[-1])
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def one(http, base, model, prompt, max_tokens, seed):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    async with http.stream("POST", f"{base}/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                times.append(time.perf_counter())
    # A chunk per token, except tokens that only complete a character later.
    return t0, times


async def run(base, model, conc, n, max_tokens):
    root = base.rsplit("/v1", 1)[0]
    sem = asyncio.Semaphore(conc)
    ps = prompts(n)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=conc + 4)) as http:
        # Warm up the pipeline (first steps, CUDA graphs, page faults).
        await one(http, base, model, ps[0], 4, 0)
        b0, w0 = busy(root), time.perf_counter()

        async def guarded(i):
            async with sem:
                return await one(http, base, model, ps[i], max_tokens, i)

        results = await asyncio.gather(*[guarded(i) for i in range(n)])
        w1, b1 = time.perf_counter(), busy(root)
    ttft = [(times[0] - t0) * 1e3 for t0, times in results if times]
    itl = [(b - a) * 1e3 for _, times in results for a, b in zip(times, times[1:])]
    wall = w1 - w0
    return {
        "concurrency": conc,
        "requests": n,
        "output_tok_s": n * max_tokens / wall,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "busy": {k: (b1[k] - b0.get(k, 0.0)) / wall for k in sorted(b1)},
        "wall_s": wall,
    }


if __name__ == "__main__":
    base, model, conc, n, max_tokens = sys.argv[1:]
    print(json.dumps(asyncio.run(run(base, model, int(conc), int(n), int(max_tokens)))))
