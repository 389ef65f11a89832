"""The load generator of scripts/bench-serve.sh: N streaming completions at
a given concurrency against `m3c serve`, each timed token by token (one SSE
chunk per token). Prints one JSON line: output tok/s, TTFT and ITL
percentiles, and each stage's busy fraction over the run (from /metrics).

    python bench_serve.py BASE_URL MODEL CONCURRENCY REQUESTS MAX_TOKENS
    python bench_serve.py BASE_URL MODEL shared REQUESTS MAX_TOKENS
    python bench_serve.py BASE_URL MODEL capacity REQUESTS MAX_TOKENS STOP
    python bench_serve.py BASE_URL MODEL images STREAMS IMAGES SECONDS_ALONE
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


def metric(root, name):
    for line in httpx.get(f"{root}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


# A long system prompt that every request of the shared-prefix workload
# sends, each with its own short question.
SYSTEM = (
    "You are the assistant of a small team that compiles the MiniMax-M3 model into pipeline-parallel executables. "
    "Answer briefly, cite the file you rely on, and say what you did not check. "
) * 6


async def first_token(http, base, body):
    """A streamed request: (seconds to its first generated token, completion tokens)."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", base, json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=1200) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices") or []:
                d = ch.get("delta") or {}
                if ttft is None and (ch.get("text") or d.get("content") or d.get("reasoning_content")):
                    ttft = time.perf_counter() - t0
    return ttft, tokens


async def shared(base, model, n, max_tokens):
    """n chats at once that share SYSTEM: TTFT and throughput, and the
    prefix cache's figures."""
    root = base.rsplit("/v1", 1)[0]
    q0, h0 = metric(root, "m3c:prefix_cache_queries_total"), metric(root, "m3c:prefix_cache_hits_total")
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as http:
        w0 = time.perf_counter()

        async def one(i):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "ignore_eos": True,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what is {i} times 7?"}]}
            return await first_token(http, f"{base}/chat/completions", body)

        got = await asyncio.gather(*[one(i) for i in range(n)])
        wall = time.perf_counter() - w0
    ttft = [t * 1e3 for t, _ in got if t is not None]
    q, h = metric(root, "m3c:prefix_cache_queries_total") - q0, metric(root, "m3c:prefix_cache_hits_total") - h0
    return {"requests": n, "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "output_tok_s": sum(k for _, k in got) / wall, "wall_s": wall, "prompt_tokens": q / n, "hit_share": h / max(q, 1)}


async def capacity(base, model, n, max_tokens, stop):
    """n completions at once, each allowed max_tokens but ending on a stop
    string: the sequences in flight (peak and mean, sampled from /metrics)
    and throughput."""
    root = base.rsplit("/v1", 1)[0]
    seen = []
    done = False

    async def watch():
        while not done:
            seen.append(await asyncio.to_thread(metric, root, "m3c:num_sequences_running"))
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as http:
        w0 = time.perf_counter()
        watcher = asyncio.create_task(watch())

        async def one(i):
            body = {"model": model, "prompt": f"Request {i}: list the numbers after {i * 7}.", "max_tokens": max_tokens,
                    "temperature": 0.8, "seed": i, "stop": [stop]}
            return await first_token(http, f"{base}/completions", body)

        got = await asyncio.gather(*[one(i) for i in range(n)])
        wall = time.perf_counter() - w0
        done = True
        await watcher
    tokens = [k for _, k in got]
    busy = [x for x in seen if x > 0] or [0.0]
    return {"requests": n, "peak_in_flight": max(seen or [0.0]), "mean_in_flight": sum(busy) / len(busy),
            "output_tok_s": sum(tokens) / wall, "mean_tokens": sum(tokens) / n, "wall_s": wall}


def png(side, seed):
    """A side×side RGB PNG whose pixels depend on `seed` (no two images alike,
    so the encoder cache never answers for another)."""
    import struct
    import zlib
    raw = b"".join(
        b"\0" + bytes(v for x in range(side) for v in ((x * 7 + y * 3 + seed * 11) % 256, (x * y + seed) % 256, (x ^ y ^ seed) % 256))
        for y in range(side)
    )
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


async def images(base, model, streams, n_images, alone_s):
    """Text streams' inter-token gaps alone for `alone_s` seconds, then while
    `n_images` image chats (672×672, each its own) arrive one after another;
    each phase's streams are cancelled (the client closes) when it ends."""
    import base64

    urls = ["data:image/png;base64," + base64.b64encode(png(672, i)).decode() for i in range(n_images + 1)]

    async def text(http, i, stop):
        body = {"model": model, "prompt": f"Stream {i}: count from {i * 100} onwards.", "max_tokens": 3000, "temperature": 0.8,
                "seed": i, "ignore_eos": True, "stream": True}
        times = []
        async with http.stream("POST", f"{base}/completions", json=body, timeout=900) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
                if stop.is_set():
                    break
        return times

    async def image(http, k):
        body = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": urls[k]}}, {"type": "text", "text": "What is in this picture?"}]}]}
        t0 = time.perf_counter()
        r = await http.post(f"{base}/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        return time.perf_counter() - t0

    def gaps(runs, since):
        out = []
        for times in runs:
            ts = [t for t in times if t >= since]
            out += [b - a for a, b in zip(ts, ts[1:])]
        return out

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + n_images + 4)) as http:
        # Warm up: the tower's first encode, the text path.
        await image(http, n_images)
        result = {}
        for phase in ["alone", "images"]:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(text(http, i, stop)) for i in range(streams)]
            await asyncio.sleep(2.0)  # every stream decoding
            t0 = time.perf_counter()
            if phase == "alone":
                await asyncio.sleep(alone_s)
                latency = []
            else:
                latency = []
                for k in range(n_images):
                    latency.append(await image(http, k))
            t1 = time.perf_counter()
            stop.set()
            runs = await asyncio.gather(*tasks)
            g = [x for x in gaps([[t for t in r if t <= t1] for r in runs], t0)]
            result[phase] = {"window_s": t1 - t0, "gaps": len(g), "itl_p50_ms": pct(g, 50) * 1e3, "itl_p99_ms": pct(g, 99) * 1e3,
                             "itl_p999_ms": pct(g, 99.9) * 1e3, "itl_max_ms": max(g) * 1e3,
                             "image_latency_s": [round(x, 2) for x in latency]}
        return result


if __name__ == "__main__":
    if sys.argv[3] == "images":
        base, model, _, streams, n_images, alone_s = sys.argv[1:]
        print(json.dumps(asyncio.run(images(base, model, int(streams), int(n_images), float(alone_s)))))
    elif sys.argv[3] == "shared":
        base, model, _, n, max_tokens = sys.argv[1:]
        print(json.dumps(asyncio.run(shared(base, model, int(n), int(max_tokens)))))
    elif sys.argv[3] == "capacity":
        base, model, _, n, max_tokens, stop = sys.argv[1:]
        print(json.dumps(asyncio.run(capacity(base, model, int(n), int(max_tokens), stop))))
    else:
        base, model, conc, n, max_tokens = sys.argv[1:]
        print(json.dumps(asyncio.run(run(base, model, int(conc), int(n), int(max_tokens)))))
