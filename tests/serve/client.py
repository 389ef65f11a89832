"""m3c serve's tests, as a user's program: OpenAI's official Python client
against a running `m3c serve`. Each subcommand checks one behaviour, prints
what it saw as JSON on stdout, and exits non-zero (with the reason) when the
server misbehaves. The Rust side (tests/it/serve.rs) starts the server and
compares with `m3c run`.

    python client.py BASE_URL MODEL SUBCOMMAND [ARGS...]
"""

import asyncio
import json
import sys
import time

import httpx
import openai


def client(base, **kw):
    return openai.OpenAI(base_url=base, api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=120, **kw)


def complete(base, model, prompt, params):
    """Completions, whole and streamed: both texts, finish reasons, usage."""
    c = client(base)
    whole = c.completions.create(model=model, prompt=prompt, **params)
    text = ""
    finish = None
    usage = None
    for chunk in c.completions.create(model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **params):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    assert usage is not None, "include_usage gave no usage chunk"
    assert usage.completion_tokens == whole.usage.completion_tokens, (usage, whole.usage)
    assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
    return {
        "whole": whole.choices[0].text,
        "streamed": text,
        "finish": finish,
        "prompt_tokens": whole.usage.prompt_tokens,
        "completion_tokens": whole.usage.completion_tokens,
    }


def chat(base, model, user, params):
    """Chat completions, whole and streamed."""
    c = client(base)
    messages = [{"role": "user", "content": user}]
    whole = c.chat.completions.create(model=model, messages=messages, **params)
    content, reasoning, finish = "", "", None
    for chunk in c.chat.completions.create(model=model, messages=messages, stream=True, **params):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            finish = ch.finish_reason or finish
    m = whole.choices[0].message
    return {
        "whole": m.content or "",
        "whole_reasoning": getattr(m, "reasoning_content", None) or "",
        "streamed": content,
        "streamed_reasoning": reasoning,
        "finish": finish,
        "prompt_tokens": whole.usage.prompt_tokens,
        "completion_tokens": whole.usage.completion_tokens,
    }


async def concurrent(base, model, n, max_tokens):
    """n streaming clients, at once or arriving while the others run, each
    against its own solo run."""
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(n)]
    params = lambda i: dict(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=1000 + i, extra_body={"ignore_eos": True})
    sync = client(base)
    solo = [sync.completions.create(model=model, prompt=p, **params(i)).choices[0].text for i, p in enumerate(prompts)]
    a = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

    async def one(i):
        # Odd requests arrive while the others are already decoding.
        if i % 2:
            await asyncio.sleep(0.002 * i)
        text = ""
        stream = await a.completions.create(model=model, prompt=prompts[i], stream=True, **params(i))
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
        return text

    together = await asyncio.gather(*[one(i) for i in range(n)])
    differ = [i for i in range(n) if together[i] != solo[i]]
    assert not differ, f"requests {differ} got other text together than alone"
    assert len(set(solo)) > n // 2, "the requests should differ from each other"
    return {"n": n, "identical": n - len(differ)}


async def load(base, model, n, max_tokens):
    """n concurrent streams at once: a steady load (the caller may end it
    early by killing this process)."""
    a = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)

    async def one(i):
        tokens = 0
        stream = await a.completions.create(
            model=model, prompt=f"Load {i}.", stream=True, max_tokens=max_tokens, temperature=0.9, seed=i, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            tokens += len(chunk.choices)
        return tokens

    got = await asyncio.gather(*[one(i) for i in range(n)])
    return {"n": n, "chunks": sum(got)}


async def fault_streams(base, model, n, max_tokens, fault_after, png=None):
    """n concurrent streams, half greedy and half sampled (each with its own
    seed), with logprobs, one chat that reasons, and one about an image when
    `png` is given; once `fault_after` chunks have arrived over all of them,
    prints `fault` (the caller then harms the pipeline). Each stream's text,
    token logprobs and finish reason, to compare with a run without the
    fault."""
    a = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    seen = 0

    def arrived():
        nonlocal seen
        seen += 1
        if seen == fault_after:
            print("fault", flush=True)

    async def one(i):
        sampled = dict(temperature=0.8, top_p=0.95, seed=500 + i) if i % 2 else dict(temperature=0)
        stream = await a.completions.create(
            model=model, prompt=f"Story {i}: the {i * 3} travellers", stream=True, max_tokens=max_tokens, logprobs=2,
            extra_body={"ignore_eos": True}, **sampled
        )
        text, lps, finish = "", [], None
        async for chunk in stream:
            arrived()
            for ch in chunk.choices:
                text += ch.text
                if ch.logprobs:
                    lps += list(zip(ch.logprobs.tokens, ch.logprobs.token_logprobs))
                finish = ch.finish_reason or finish
        return {"text": text, "logprobs": lps, "finish": finish}

    async def chat(content):
        stream = await a.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], stream=True, max_tokens=max_tokens,
            temperature=0.7, seed=7, extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}, "ignore_eos": True}
        )
        content, reasoning, finish = "", "", None
        async for chunk in stream:
            arrived()
            for ch in chunk.choices:
                content += ch.delta.content or ""
                reasoning += getattr(ch.delta, "reasoning_content", None) or getattr(ch.delta, "reasoning", None) or ""
                finish = ch.finish_reason or finish
        return {"text": content, "reasoning": reasoning, "finish": finish}

    chats = [chat("Count the travellers.")]
    if png:
        import base64

        url = "data:image/png;base64," + base64.b64encode(open(png, "rb").read()).decode()
        chats.append(chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in this picture?"}]))
    answers = await asyncio.gather(*[one(i) for i in range(n)], *chats)
    return {"answers": answers}


def metric(base, name):
    root = base.rsplit("/v1", 1)[0]
    for line in httpx.get(f"{root}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def disconnect(base, model):
    """A client that goes away mid-stream: its sequence is cancelled and its
    cache returns to the budget."""
    c = client(base)
    stream = c.completions.create(model=model, prompt="Go on forever", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 5:
            break
    assert metric(base, "m3c:cache_bytes_used") > 0, "the open stream should hold cache"
    # A request that arrives meanwhile joins the running batch: it ends
    # while the long one still runs.
    short = c.completions.create(model=model, prompt="A short one", max_tokens=2)
    assert short.usage.completion_tokens == 2
    assert metric(base, "m3c:num_requests_running") >= 1, "the long stream should still be running"
    stream.response.close()
    at_close = metric(base, "m3c:generation_tokens_total")
    deadline = time.time() + 20
    while time.time() < deadline:
        if metric(base, "m3c:cache_bytes_used") == 0 and metric(base, "m3c:num_requests_running") == 0:
            after = metric(base, "m3c:generation_tokens_total") - at_close
            # Cancelled within a few steps, not run out to its 3000 tokens.
            assert after < 500, f"{after} tokens were generated after the disconnect"
            return {"chunks": got, "freed": True, "after_close": after}
        time.sleep(0.05)
    raise AssertionError("the cache was not freed within 20 s of the disconnect")


async def shared_prefix(base, model, n):
    """n chats that share a long system prompt, each with its own question,
    all at once: their texts and logprobs (to compare across servers), and
    the KV pool's figures once they are done (every block back: held by no
    sequence, at most cached)."""
    system = "You are a careful assistant for the m3c project. " * 3
    a = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

    async def one(i):
        r = await a.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
            max_tokens=8,
            temperature=0.9,
            seed=100 + i,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
        ch = r.choices[0]
        lps = [[t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]] for t in ch.logprobs.content]
        return {"text": ch.message.content, "reasoning": getattr(ch.message, "reasoning_content", None), "logprobs": lps, "prompt_tokens": r.usage.prompt_tokens}

    got = await asyncio.gather(*[one(i) for i in range(n)])
    deadline = time.time() + 20
    while metric(base, "m3c:kv_cache_usage_perc") != 0 or metric(base, "m3c:num_requests_running") != 0:
        assert time.time() < deadline, "the KV blocks were not all given back within 20 s"
        time.sleep(0.05)
    figures = {
        name: metric(base, f"m3c:{name}")
        for name in ["prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "kv_cache_blocks_total", "kv_cache_blocks_cached", "cache_bytes_used"]
    }
    return {"answers": got, "metrics": figures}


async def spec_streams(base, model, n, max_tokens):
    """n streams at once (odd ones arriving while the others decode):
    greedy, sampled, penalised, with a stop string, min_tokens or a JSON
    object, each with its logprobs, for comparing a server that speculates
    with one that does not; then the server's speculation, preemption and
    prefix-cache counts once every request is done."""
    shared = "Repeat after me: one two three, one two three, one two three. "
    a = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

    async def one(i):
        kw = dict(max_tokens=max_tokens, seed=500 + i, logprobs=2, extra_body={"ignore_eos": True})
        kw["temperature"] = 0.0 if i % 2 == 0 else 0.6
        if i % 4 == 1:
            kw.update(presence_penalty=0.4, frequency_penalty=0.2)
        if i % 4 == 3:
            kw["extra_body"] = {"ignore_eos": False, "min_tokens": 6, "repetition_penalty": 1.1}
        if i % 8 == 6:
            kw["stop"] = [" t"]
        if i % 2:
            await asyncio.sleep(0.002 * i)
        text, lps, finish = "", [], None
        stream = await a.completions.create(model=model, prompt=shared + f"Request {i}.", stream=True, **kw)
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                if ch.logprobs is not None:
                    lps += list(zip(ch.logprobs.tokens, ch.logprobs.token_logprobs))
                finish = ch.finish_reason or finish
        return {"text": text, "logprobs": lps, "finish": finish}

    got = await asyncio.gather(*[one(i) for i in range(n)])
    deadline = time.time() + 20
    while metric(base, "m3c:num_requests_running") != 0:
        assert time.time() < deadline, "requests still running 20 s after their answers"
        time.sleep(0.05)
    names = ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"]
    names += ["num_preemptions_total", "prefix_cache_hits_total"]
    return {"answers": got, "metrics": {name: metric(base, f"m3c:{name}") for name in names}}


def tools(base, model):
    """A tool-call round trip: tools rendered into the prompt, then the
    assistant's call and the tool's result sent back."""
    c = client(base)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = c.chat.completions.create(model=model, messages=ask, max_tokens=4, seed=1)
    first = c.chat.completions.create(model=model, messages=ask, tools=[weather], max_tokens=4, seed=1)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens, "the tools should be in the prompt"
    none = c.chat.completions.create(model=model, messages=ask, tools=[weather], tool_choice="none", max_tokens=4, seed=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens, "tool_choice none leaves the tools out"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    follow = ask + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    second = c.chat.completions.create(model=model, messages=follow, tools=[weather], max_tokens=4, seed=1)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens, "the call and its result should be in the prompt"
    return {"plain": plain.usage.prompt_tokens, "with_tools": first.usage.prompt_tokens, "round_trip": second.usage.prompt_tokens,
            "finish": second.choices[0].finish_reason}


def errors(base, model):
    """Bad input gets 4xx with OpenAI's error object, and the server stays up."""
    root = base.rsplit("/v1", 1)[0]
    seen = {}

    def post(path, body, raw=False):
        r = httpx.post(f"{root}{path}", content=body if raw else json.dumps(body), headers={"content-type": "application/json"}, timeout=30)
        e = r.json().get("error", {})
        assert e.get("message"), f"{path} {body!r}: no OpenAI error object in {r.text}"
        return r.status_code, e

    seen["malformed"] = post("/v1/completions", b"{not json", raw=True)[0]
    seen["not_object"] = post("/v1/completions", [1, 2], )[0]
    seen["wrong_type"], e = post("/v1/completions", {"model": model, "prompt": "x", "temperature": "hot"})
    assert e["param"] == "temperature", e
    seen["unknown_model"] = post("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})[0]
    seen["no_messages"] = post("/v1/chat/completions", {"model": model})[0]
    seen["bad_role"] = post("/v1/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]})[0]
    seen["too_long"], e = post("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 10_000_000})
    assert "maximum context length" in e["message"], e
    seen["n"] = post("/v1/completions", {"model": model, "prompt": "x", "n": 17})[0]
    seen["huge_max"] = post("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2**64 - 1})[0]
    seen["tiny_temperature"] = post("/v1/completions", {"model": model, "prompt": "x", "temperature": 1e-30})[0]
    seen["top_p"] = post("/v1/completions", {"model": model, "prompt": "x", "top_p": 0})[0]
    seen["bad_id"] = post("/v1/completions", {"model": model, "prompt": [10**9]})[0]
    seen["route"] = httpx.get(f"{root}/v1/nothing", timeout=10).status_code
    # A method a route does not take: 405, as a JSON error like the others.
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize"]:
        r = httpx.get(f"{root}{path}", timeout=10)
        e = r.json()["error"]
        assert r.status_code == 405 and "POST" in e["message"] and path in e["message"], (path, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json"), r.headers
    seen["get_on_post"] = r.status_code
    # The official client raises the matching exceptions.
    c = client(base)
    try:
        c.completions.create(model="nope", prompt="x", max_tokens=1)
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError:
        seen["client_404"] = True
    try:
        c.completions.create(model=model, prompt="x", max_tokens=1, temperature=-1)
        raise AssertionError("a negative temperature was taken")
    except openai.BadRequestError:
        seen["client_400"] = True
    # Fields m3c cannot honour (yet, or as given) are 400s naming the
    # field, never free text in place of what was asked for.
    msgs = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for case, kw in [
        ("bad_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}}),
        ("bad_regex", {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}),
        ("backend", {"extra_body": {"guided_decoding_backend": "xgrammar"}}),
        ("tool_required", {"tool_choice": "required"}),
        ("tool_named", {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
        ("tool_unenforceable", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"}),
        ("unknown", {"extra_body": {"frobnicate": 1}}),
    ]:
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=2, **kw)
            raise AssertionError(f"{case}: answered instead of refused")
        except openai.BadRequestError as e:
            seen[f"refused_{case}"] = e.param
    # Still serving.
    ok = c.completions.create(model=model, prompt="x", max_tokens=2)
    seen["after"] = ok.usage.completion_tokens
    return seen


def auth(base, model, key):
    """--api-key: Bearer auth on /v1, none on /health."""
    root = base.rsplit("/v1", 1)[0]
    out = {"health": httpx.get(f"{root}/health", timeout=10).status_code}
    try:
        client(base, api_key="wrong").models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError:
        out["wrong_key"] = 401
    out["models"] = [m.id for m in client(base, api_key=key).models.list().data]
    return out


def busy(base, model):
    """--max-batch 1 --max-queue 0: a second request while one runs gets 503."""
    c = client(base)
    stream = c.completions.create(model=model, prompt="Hold the slot", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    try:
        c.completions.create(model=model, prompt="x", max_tokens=1)
        raise AssertionError("a request past --max-queue was taken")
    except openai.InternalServerError as e:
        status = e.status_code
    stream.response.close()
    return {"second": status}


def poison(base, model):
    """A prompt that meets non-finite logits (its first token's embedding is
    Inf) fails alone; the others, before and after, are served."""
    c = client(base)
    root = base.rsplit("/v1", 1)[0]
    # Greedy, so the continuation is fixed (and stays clear of ids 0-15).
    ok1 = c.completions.create(model=model, prompt=[20, 21, 22], max_tokens=3, temperature=0)
    try:
        c.completions.create(model=model, prompt=[3, 20, 21], max_tokens=3)
        raise AssertionError("the poisoned prompt was served")
    except openai.APIStatusError as e:
        failed = e.status_code
        assert "non-finite" in str(e), e
    ok2 = c.completions.create(model=model, prompt=[20, 21, 22], max_tokens=3, temperature=0)
    assert ok1.usage.completion_tokens == 3
    # The failed request gave its KV blocks back, as the served ones did.
    deadline = time.time() + 10
    while metric(base, "m3c:kv_cache_usage_perc") != 0:
        assert time.time() < deadline, "KV blocks are still held after every request ended"
        time.sleep(0.05)
    return {"failed": failed, "after": ok2.usage.completion_tokens, "health": httpx.get(f"{root}/health", timeout=10).status_code,
            "failed_total": metric(base, "m3c:requests_failed_total")}


def stream_until_end(base, model):
    """One long streaming request, reporting how it ended (for the shutdown
    and lost-stage tests, which act on the server while it runs)."""
    c = client(base)
    text, finish, error, told = "", None, None, False
    try:
        for chunk in c.completions.create(model=model, prompt="Keep going", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}):
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
            if text and not told:
                print("streaming", flush=True)
                told = True
    except Exception as e:  # the error event of a failed stream
        error = f"{type(e).__name__}: {e}"
    return {"finish": finish, "error": error, "chars": len(text)}


class _Media:
    """A local image server on 127.0.0.1: /image.png, /slow.png (answers
    after 30 s), /big.png (a body past any limit), /missing.png (404)."""

    def __init__(self, png_bytes):
        import http.server
        import threading

        body = png_bytes

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == "/image.png":
                    data = body
                elif self.path == "/slow.png":
                    time.sleep(30)
                    data = body
                elif self.path == "/big.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    try:
                        for _ in range(64):
                            self.wfile.write(b"\0" * (1 << 20))
                    except OSError:
                        pass
                    return
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"


def _image_chat(c, model, url, user, **kw):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": user}]}]
    params = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}})
    params.update(kw)
    return c.chat.completions.create(model=model, messages=messages, **params)


def image_chat(base, model, png, user):
    """One chat with an image sent as a data: URI (its bytes travel with the
    request), whole and streamed: the text, and the prompt's length."""
    import base64

    c = client(base)
    url = "data:image/png;base64," + base64.b64encode(open(png, "rb").read()).decode()
    whole = _image_chat(c, model, url, user)
    streamed = ""
    for chunk in _image_chat(c, model, url, user, stream=True):
        for ch in chunk.choices:
            streamed += ch.delta.content or ""
    text = whole.choices[0].message.content or ""
    assert streamed == text, f"streamed {streamed!r} vs whole {text!r}"
    return {"text": text, "prompt_tokens": whole.usage.prompt_tokens}


def video(base, model, mp4, allowed):
    """A video by data: URI and as a file:// path give the same answer
    (greedy, with logprobs); the second asking finds its prompt, video rows
    included, in the prefix cache; a broken video is a 400 naming its part."""
    import base64

    c = client(base)
    raw = open(mp4, "rb").read()
    data_url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    user = "What moves?"

    def ask(url):
        messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": user}]}]
        r = c.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}},
        )
        lp = [[t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]] for t in r.choices[0].logprobs.content]
        return {"text": r.choices[0].message.content or "", "prompt_tokens": r.usage.prompt_tokens, "logprobs": lp}

    hits0 = metric(base, "m3c:prefix_cache_hits_total")
    first = ask(data_url)
    hits1 = metric(base, "m3c:prefix_cache_hits_total")
    again = ask("file://" + allowed)
    hits2 = metric(base, "m3c:prefix_cache_hits_total")
    # The stage reports its encoder's figures when they change (the loop's
    # next turn): wait for the second asking's lookups to show.
    deadline = time.time() + 10
    while metric(base, "m3c:encoder_cache_hits_total") + metric(base, "m3c:encoder_cache_misses_total") < 4 and time.time() < deadline:
        time.sleep(0.05)
    encoder = {k: metric(base, f"m3c:encoder_{k}") for k in ["cache_hits_total", "cache_misses_total", "cache_entries", "grids_total"]}
    assert again == first, f"file:// {again} vs data: {first}"
    broken = "data:video/mp4;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    status, message = None, ""
    try:
        ask(broken)
    except openai.BadRequestError as e:
        status, message = e.status_code, str(e)
    return {**first, "cold_hits": hits1 - hits0, "warm_hits": hits2 - hits1, "broken_status": status, "broken_message": message, "encoder": encoder}


def images(base, model, png, allowed, outside):
    """An image by data: URI, by http URL from a local server and as a
    file:// path inside the allowed folder all give the same answer; it runs
    beside text-only requests unchanged; bad images are 400s naming the part."""
    import base64

    c = client(base)
    raw = open(png, "rb").read()
    data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
    user = "What is in this picture?"
    first = _image_chat(c, model, data_url, user)
    text = first.choices[0].message.content or ""
    streamed = ""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": user}]}]
    for chunk in c.chat.completions.create(
        model=model, messages=messages, stream=True, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}},
    ):
        for ch in chunk.choices:
            streamed += ch.delta.content or ""
    assert streamed == text, f"streamed {streamed!r} vs whole {text!r}"
    media = _Media(raw)
    by_http = _image_chat(c, model, media.url + "/image.png", user).choices[0].message.content or ""
    assert by_http == text, f"http {by_http!r} vs data: {text!r}"
    by_file = _image_chat(c, model, "file://" + allowed, user).choices[0].message.content or ""
    assert by_file == text, f"file {by_file!r} vs data: {text!r}"

    # Beside text-only requests: every request gets its solo answer.
    prompts = [f"Tell me about {i}." for i in range(6)]
    tparams = lambda i: dict(max_tokens=8, temperature=0.9, seed=40 + i, extra_body={"ignore_eos": True})
    solo = [c.completions.create(model=model, prompt=p, **tparams(i)).choices[0].text for i, p in enumerate(prompts)]
    a = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

    async def together():
        img = a.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}},
        )
        texts = [a.completions.create(model=model, prompt=p, **tparams(i)) for i, p in enumerate(prompts)]
        return await asyncio.gather(img, *texts)

    got = asyncio.run(together())
    assert (got[0].choices[0].message.content or "") == text, "the image request beside text requests"
    differ = [i for i in range(6) if got[i + 1].choices[0].text != solo[i]]
    assert not differ, f"text requests {differ} changed beside an image request"

    # Bad images: a 400 naming the content part, the server still up.
    h = httpx.Client(timeout=120)
    def bad(url, want, role="user"):
        body = {"model": model, "max_tokens": 2, "messages": [
            {"role": role, "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
        t0 = time.time()
        r = h.post(base + "/chat/completions", json=body)
        msg = r.json().get("error", {}).get("message", "")
        assert r.status_code == 400 and want in msg, f"{url[:60]}: {r.status_code} {msg!r}"
        return time.time() - t0
    bad("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "messages[0].content[0].image_url")
    bad("data:image/png;base64,@@@", "not valid base64")
    bad(media.url + "/missing.png", "404")
    slow = bad(media.url + "/slow.png", "within 2 s")
    assert slow < 15, f"the slow fetch took {slow:.1f} s"
    bad(media.url + "/big.png", "limit")
    bad("file://" + outside, "outside the allowed media folder")
    bad("ftp://example/x.png", "not a data:, http(s):// or file:// URL")
    bad(data_url, "images go in user messages", role="assistant")
    import os
    # A data: URI past the server's image limit is a 400 naming the limit
    # (not the HTTP layer's 413): 2 MB of bytes, 2.7 MB of base64.
    bad("data:image/png;base64," + base64.b64encode(os.urandom(2 << 20)).decode(), "limit")
    # More images than --max-images-per-request.
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content":
            [{"type": "image_url", "image_url": {"url": data_url}}] * 9 + [{"type": "text", "text": "hi"}]}]}
    r = h.post(base + "/chat/completions", json=body)
    assert r.status_code == 400 and "at most 8" in r.text, f"nine images: {r.status_code} {r.text}"
    # The placeholder token typed as text, or sent as an id, has no image.
    r = h.post(base + "/chat/completions", json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "]<]image[>[ hi"}]})
    assert r.status_code == 400 and "image and video placeholder" in r.text, f"placeholder text: {r.status_code} {r.text}"
    r = h.post(base + "/completions", json={"model": model, "max_tokens": 2, "prompt": [1, 500, 2]})
    assert r.status_code == 400 and "image and video placeholder" in r.text, f"placeholder id: {r.status_code} {r.text}"
    ok = _image_chat(c, model, data_url, user).choices[0].message.content or ""
    assert ok == text, "the server answers as before after the errors"
    return {"text": text, "prompt_tokens": first.usage.prompt_tokens}


def choices_and_tokens(base, model, ids, stop_id):
    """n choices, stop_token_ids, include_stop_str_in_output,
    skip_special_tokens and the /tokenize, /detokenize and /version routes.
    `ids`: a prompt's greedy continuation's first tokens, as m3c run gives
    them; `stop_id` is its third and not among the first two."""
    c = client(base)
    root = base.removesuffix("/v1")
    prompt = [5, 6, 7]
    out = {}
    # n = 3: each choice is the n = 1 answer of seed + its index.
    sampled = dict(max_tokens=8, temperature=0.9, extra_body={"ignore_eos": True})
    whole = c.completions.create(model=model, prompt=prompt, n=3, seed=11, **sampled)
    assert [ch.index for ch in whole.choices] == [0, 1, 2], whole.choices
    alone = [c.completions.create(model=model, prompt=prompt, seed=11 + i, **sampled).choices[0].text for i in range(3)]
    assert [ch.text for ch in whole.choices] == alone, ([ch.text for ch in whole.choices], alone)
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == 3, whole.usage
    texts, usage, finishes = ["", "", ""], None, {}
    for chunk in c.completions.create(model=model, prompt=prompt, n=3, seed=11, stream=True, stream_options={"include_usage": True}, **sampled):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
    assert texts == alone and finishes == {0: "length", 1: "length", 2: "length"}, (texts, finishes)
    assert usage is not None and usage.completion_tokens == 24, usage
    out["n_distinct"] = len(set(alone))
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, temperature=1, seed=3, extra_body={"ignore_eos": True})
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8, chat
    # stop_token_ids: the choice ends on the stop id, whose text is left
    # out unless include_stop_str_in_output.
    greedy = lambda n, **extra: c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True, **extra})
    stopped = greedy(8, stop_token_ids=[stop_id])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 3, stopped
    assert stopped.choices[0].text == greedy(2).choices[0].text, (stopped.choices[0].text, greedy(2).choices[0].text)
    # min_tokens holds the stop id back: the greedy path goes on past it.
    held = greedy(8, stop_token_ids=[stop_id], min_tokens=5)
    assert held.usage.completion_tokens >= 6, held
    assert held.choices[0].text.startswith(greedy(2).choices[0].text), (held.choices[0].text, greedy(2).choices[0].text)
    out["min_tokens"] = held.usage.completion_tokens
    kept = greedy(8, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.choices[0].text == greedy(3).choices[0].text, kept
    # include_stop_str_in_output with a stop string: the text ends with it.
    full = greedy(6).choices[0].text
    stop = full[len(full) // 2 :][:2]
    cut = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    inc = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].text == cut.choices[0].text + stop and full.startswith(inc.choices[0].text), (full, stop, cut, inc)
    # skip_special_tokens false: the text is every token's, as /detokenize gives it.
    raw = greedy(len(ids), skip_special_tokens=False).choices[0].text
    detok = httpx.post(f"{root}/detokenize", json={"model": model, "tokens": ids}, timeout=30).json()
    assert raw == detok["prompt"], (raw, detok)
    # echo: the answer starts with the prompt's text, whole and streamed.
    plain = c.completions.create(model=model, prompt="Hello world", max_tokens=4, temperature=0).choices[0].text
    echoed = c.completions.create(model=model, prompt="Hello world", max_tokens=4, temperature=0, echo=True).choices[0].text
    streamed = "".join(ch.text for chunk in c.completions.create(model=model, prompt="Hello world", max_tokens=4, temperature=0,
                                                                echo=True, stream=True) for ch in chunk.choices)
    assert echoed == streamed == "Hello world" + plain, (echoed, streamed, plain)
    # /tokenize: the prompt and chat token counts the generation routes use.
    text = "Hello world, tokenize me."
    t = httpx.post(f"{root}/tokenize", json={"model": model, "prompt": text, "return_token_strs": True}, timeout=30).json()
    used = c.completions.create(model=model, prompt=text, max_tokens=1).usage.prompt_tokens
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) == used and t["max_model_len"] > 0, (t, used)
    back = httpx.post(f"{root}/detokenize", json={"tokens": t["tokens"]}, timeout=30).json()["prompt"]
    assert back == text, back
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tc = httpx.post(f"{root}/tokenize", json={"model": model, "messages": messages}, timeout=30).json()
    chat_used = c.chat.completions.create(model=model, messages=messages, max_tokens=1).usage.prompt_tokens
    assert tc["count"] == chat_used, (tc["count"], chat_used)
    bad = httpx.post(f"{root}/tokenize", json={"prompt": "x", "add_bos": True}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_bos", bad.text
    bad = httpx.post(f"{root}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text
    out["version"] = httpx.get(f"{root}/version", timeout=10).json()["version"]
    out["tokens"] = t["count"]
    return out


def logprobs(base, model):
    """Logprobs on both endpoints, whole and streamed: each token's own
    logprob and its alternatives, most likely first, all <= 0; greedy picks
    the top one. Returns the completions' per-token logprobs of a greedy
    continuation of [5, 6, 7] (checked against the stages' logits by the
    caller)."""
    c = client(base)
    prompt = [5, 6, 7]
    greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(model=model, prompt=prompt, logprobs=5, **greedy)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6, lp
    for own, top in zip(lp.token_logprobs, lp.top_logprobs):
        # (Completions key alternatives by text, so tokens of one text merge.)
        assert own <= 0 and all(v <= 0 for v in top.values()) and 1 <= len(top) <= 5, (own, top)
        assert own >= max(top.values()) - 1e-6, ("greedy takes the most likely token", own, top)
    assert "".join(lp.tokens) == whole.choices[0].text, (lp.tokens, whole.choices[0].text)
    streamed = []
    for chunk in c.completions.create(model=model, prompt=prompt, logprobs=5, stream=True, **greedy):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed += ch.logprobs.token_logprobs
    assert streamed == lp.token_logprobs, (streamed, lp.token_logprobs)
    # Chat: logprobs true with top_logprobs, sampled; whole and streamed agree.
    messages = [{"role": "user", "content": "Hi"}]
    kw = dict(max_tokens=5, temperature=0.8, seed=4, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(model=model, messages=messages, **kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5, content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()), t
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6, t
    got = []
    for chunk in c.chat.completions.create(model=model, messages=messages, stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                got += [(t.token, t.logprob) for t in ch.logprobs.content]
    assert got == [(t.token, t.logprob) for t in content], (got, content)
    # Greedy chat: the token is the first alternative.
    g = c.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    for t in g.choices[0].logprobs.content:
        assert t.top_logprobs[0].logprob == t.logprob and t.top_logprobs[0].token == t.token, t
    # Without the flag, no logprobs.
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None, plain
    return {"logprobs": lp.token_logprobs, "tokens": lp.tokens}


def prompt_logprobs(base, model):
    """Completions' echo with logprobs (lm-evaluation-harness's scoring
    request) and vLLM's prompt_logprobs on both routes, whole and streamed.
    Returns the prompt [5, 6, 7]'s logprobs (checked against the stages'
    logits by the caller)."""
    c = client(base)
    prompt = [5, 6, 7]
    kw = dict(max_tokens=2, temperature=0, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    whole = c.completions.create(model=model, prompt=prompt, **kw)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5, lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:]), lp
    assert lp.text_offset == sorted(lp.text_offset), lp.text_offset
    streamed, text = [], ""
    for chunk in c.completions.create(model=model, prompt=prompt, stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                streamed += ch.logprobs.token_logprobs
    assert streamed == lp.token_logprobs and text == whole.choices[0].text, (streamed, lp.token_logprobs, text)
    # vLLM's prompt_logprobs: null first, then each token's entry by id.
    p = c.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 3})
    entries = p.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 3, entries
    for tok, e in zip(prompt[1:], entries[1:]):
        assert str(tok) in e and 3 <= len(e) <= 4, e
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in e.values()), e
    chunks = [ch.model_extra.get("prompt_logprobs") for chunk in c.completions.create(
        model=model, prompt=prompt, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 3}) for ch in chunk.choices]
    assert [x for x in chunks if x is not None] == [entries], chunks
    # Chat: beside the choices, one entry per prompt token.
    msgs = [{"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=1, extra_body={"prompt_logprobs": 0})
    pl = r.model_extra["prompt_logprobs"]
    assert len(pl) == r.usage.prompt_tokens and pl[0] is None and all(len(e) == 1 for e in pl[1:]), pl
    return {"echo": lp.token_logprobs[:3], "prompt": [{k: [v["logprob"], v["rank"]] for k, v in e.items()} for e in entries[1:]]}


def penalties(base, model, plain, penal):
    """presence_penalty, frequency_penalty and logit_bias through the openai
    client. `plain`: m3c run's greedy continuation of [5, 6, 7]; `penal`:
    its greedy continuation under presence -2 and frequency -0.75 (checked
    against the dumped logits by the caller)."""
    c = client(base)
    root = base.removesuffix("/v1")
    prompt = [5, 6, 7]
    detok = lambda ids: httpx.post(f"{root}/detokenize", json={"model": model, "tokens": ids}, timeout=30).json()["prompt"]
    greedy = lambda n, **kw: c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                                  extra_body={"ignore_eos": True, "skip_special_tokens": False}, **kw).choices[0].text
    got = greedy(len(penal), presence_penalty=-2, frequency_penalty=-0.75)
    assert got == detok(penal), ("served under the penalties", got, detok(penal))
    assert greedy(len(plain)) == detok(plain), "without them, the plain path"
    # A bias of 100 forces its token; -100 bans the greedy one.
    forced = next(i for i in range(100, 1000) if i not in plain)
    assert greedy(4, logit_bias={str(forced): 100}) == detok([forced] * 4), (forced, greedy(4, logit_bias={str(forced): 100}))
    banned = greedy(1, logit_bias={str(plain[0]): -100})
    assert banned != detok(plain[:1]), ("a -100 bias on the greedy token", banned)
    # Sampled and on chat, the typed arguments are taken.
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.8, seed=2,
                                  presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={str(forced): 5})
    assert r.usage.completion_tokens >= 1, r
    for bad in [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(logit_bias={"1000000000": 1}), dict(logit_bias={"5": 101})]:
        try:
            c.completions.create(model=model, prompt=prompt, max_tokens=1, **bad)
        except openai.BadRequestError as e:
            assert e.body["param"] == next(iter(bad)), (bad, e.body)
        else:
            raise AssertionError(f"{bad} was taken")
    return {"forced": forced}


def responses(base, model, user, params):
    """OpenAI's Responses API, whole and streamed, through the official
    client: the text equals the chat route's for the same conversation."""
    c = client(base)
    params = json.loads(params)
    r = c.responses.create(model=model, input=user, instructions="Be brief.", **params)
    assert r.object == "response" and r.status in ("completed", "incomplete"), r
    assert r.output_text, r
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]
    chat_params = {k: v for k, v in params.items() if k != "max_output_tokens"}
    chat = c.chat.completions.create(model=model, messages=messages, max_tokens=params["max_output_tokens"], **chat_params)
    assert r.output_text == (chat.choices[0].message.content or ""), (r.output_text, chat.choices[0].message.content)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens, (r.usage, chat.usage)
    # Streamed: the deltas add up to the text, and the last event carries the response.
    deltas, kinds, final = "", [], None
    with c.responses.stream(model=model, input=user, instructions="Be brief.", **params) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
        final = s.get_final_response()
    assert deltas == r.output_text and final.output_text == r.output_text, (deltas, final.output_text, r.output_text)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and final.status == r.status, (kinds, final.status)
    # Message items as input, and fields m3c cannot honour refused by name.
    items = [{"role": "user", "content": [{"type": "input_text", "text": user}]}]
    again = c.responses.create(model=model, input=items, instructions="Be brief.", **params)
    assert again.output_text == r.output_text, (again.output_text, r.output_text)
    for bad, field in [({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
                       ({"store": True}, "store"),
                       ({"previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"text": {"format": {"type": "json_object"}}}, "text")]:
        try:
            c.responses.create(model=model, input=user, **bad)
            raise AssertionError(f"{field} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == field, (field, e.body)
    return {"text": r.output_text, "status": r.status, "events": len(kinds)}


def thinking_kwargs(mode):
    """The chat_template_kwargs of a thinking mode ("adaptive" is the
    template's default: no kwargs at all)."""
    return {} if mode == "adaptive" else {"chat_template_kwargs": {"thinking_mode": mode}}


def structured(base, model, mode="disabled"):
    """Structured outputs on the tiny model's random weights: the constraint
    alone makes every answer valid. parse() with a Pydantic model, a JSON
    object, a regex, a choice and a Lark grammar, on both endpoints, whole
    and streamed; a bad schema or regex is a 400 naming its field. `mode`:
    the chat's thinking mode."""
    import re
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        legs: int = Field(ge=0, le=8)
        tame: bool

    c = client(base)
    off = thinking_kwargs(mode)
    out = {}
    msgs = [{"role": "user", "content": "Describe a pet as JSON."}]
    for seed in range(3):
        r = c.chat.completions.parse(model=model, messages=msgs, response_format=Pet, max_tokens=60, temperature=1.0, seed=seed, extra_body=off)
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.legs <= 8 and len(pet.name) <= 6, (r.choices[0].message.content, pet)
        out.setdefault("pets", []).append(r.choices[0].message.content)
    # Any JSON object, streamed.
    text = ""
    for chunk in c.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=1.0, seed=5, stream=True,
                                           response_format={"type": "json_object"}, extra_body=off):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    obj_ok = True
    try:
        assert isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        # 40 tokens may end an object early: it must then be a prefix of one.
        obj_ok = text.startswith("{")
    assert obj_ok, text
    # vLLM's structured_outputs on completions: a regex matched exactly, a choice.
    for seed in range(3):
        r = c.completions.create(model=model, prompt="Code:", max_tokens=12, temperature=1.0, seed=seed,
                                 extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        r = c.completions.create(model=model, prompt="Pick:", max_tokens=12, temperature=1.0, seed=seed,
                                 extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert r.choices[0].text in ("red", "green", "blue"), r.choices[0].text
    r = c.completions.create(model=model, prompt="Yes or no:", max_tokens=8, temperature=1.0, seed=1,
                             extra_body={"guided_grammar": 'start: "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no"), r.choices[0].text
    # With a repetition penalty too (its bitmap and the grammar's are separate rows).
    r = c.completions.create(model=model, prompt="Digits:", max_tokens=8, temperature=1.0, seed=4,
                             extra_body={"repetition_penalty": 1.3, "structured_outputs": {"regex": "[0-9]{5}"}})
    assert re.fullmatch(r"[0-9]{5}", r.choices[0].text), r.choices[0].text
    # n choices, each constrained.
    r = c.completions.create(model=model, prompt="Digits:", max_tokens=8, temperature=1.0, seed=9, n=3,
                             extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert all(re.fullmatch(r"[0-9]{4}", ch.text) for ch in r.choices), [ch.text for ch in r.choices]
    # Bad grammars and conflicts: 400 naming the field.
    for body, field in [({"structured_outputs": {"regex": "("}}, "structured_outputs"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
                        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex")]:
        try:
            c.completions.create(model=model, prompt="x", max_tokens=4, extra_body=body)
            raise AssertionError(f"{body} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == field, (field, e.body)
    out["regex_ok"] = True
    return out


def forced_tools(base, model, mode="disabled"):
    """tool_choice "required" and a named function on random weights: the
    grammar alone makes every answer a call in MiniMax-M3's format whose
    arguments validate (pydantic, strict) against the tool's schema; a
    schema keyword the grammar cannot enforce, an unknown name and a second
    grammar are 400s naming their field."""
    from typing import Literal, Optional
    from pydantic import BaseModel, ConfigDict, Field

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        hourly: bool
        threshold: Optional[float] = None

    class Weather(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        city: str = Field(max_length=6)
        days: int
        unit: Optional[Literal["c", "f"]] = None
        tags: Optional[list[str]] = Field(default=None, max_length=2)
        options: Optional[Options] = None

    class Search(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        query: str = Field(min_length=1, max_length=5)

    weather = {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer"},
            "unit": {"enum": ["c", "f"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
            "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}, "threshold": {"type": "number"}},
                        "required": ["hourly"]},
        },
        "required": ["city", "days"],
    }}}
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 5}}, "required": ["query"]}}}
    models = {"get_weather": Weather, "search": Search}
    c = client(base)
    off = thinking_kwargs(mode)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    out = {"calls": 0}

    def check(r, single=None):
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (ch.finish_reason, ch.message)
        calls = ch.message.tool_calls
        assert calls and (single is None or (len(calls) == 1 and calls[0].function.name == single)), calls
        for call in calls:
            models[call.function.name].model_validate_json(call.function.arguments)
        out["calls"] += len(calls)

    for seed in range(3):
        check(c.chat.completions.create(model=model, messages=msgs, tools=[weather, search], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=400, temperature=1.0, seed=seed, extra_body=off))
    # Any number of calls, streamed: the deltas rebuild valid calls.
    args, names, finish = {}, {}, None
    for chunk in c.chat.completions.create(model=model, messages=msgs, tools=[weather, search], tool_choice="required", max_tokens=800,
                                           temperature=1.0, seed=7, stream=True, extra_body=off):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                names[d.index] = d.function.name or names.get(d.index)
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert finish == "tool_calls" and names, (finish, names, args)
    for i, name in names.items():
        models[name].model_validate_json(args[i])
    # A named function: one call of it.
    named = {"type": "function", "function": {"name": "search"}}
    check(c.chat.completions.create(model=model, messages=msgs, tools=[weather, search], tool_choice=named, max_tokens=100,
                                    temperature=1.0, seed=3, extra_body=off), single="search")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}
    for kw, field in [(dict(tools=[weather], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tools=[bad_schema], tool_choice="required"), "tools"),
                      (dict(tools=[weather], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
                      (dict(tools=[weather], parallel_tool_calls=False), "parallel_tool_calls")]:
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=4, **kw)
            raise AssertionError(f"{kw} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == field, (field, e.body)
    return out


# The tiny tokenizer's reasoning tags (MiniMax-M3's 200059 and 200060).
OPEN, CLOSE = 495, 496


def chat_constraints(base, model, mode):
    """Chat constraints under one thinking mode when the model will not stop
    reasoning: steered with logit_bias to open its reasoning and never
    close it, it still answers validly once its budget is spent (the
    closing tag is forced), and a budget larger than max_tokens ends in
    finish "length" with no unconstrained content. (agents.py samples the
    constraints unsteered over many seeds.)"""
    import re
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        legs: int = Field(ge=0, le=8)
        tame: bool

    c = client(base)
    kw = thinking_kwargs(mode)
    msgs = [{"role": "user", "content": "Answer in the format asked."}]
    out = {"mode": mode, "outcomes": []}
    steer = {"never_closes": {str(OPEN): 100, str(CLOSE): -100}}

    def ask(name, how, check, stream=False, **extra):
        body = dict(kw)
        body.update(extra.pop("extra_body", {}))
        params = dict(model=model, messages=msgs, max_tokens=extra.pop("max_tokens", 100), temperature=1.0, seed=extra.pop("seed", 3),
                      logit_bias=steer[how], extra_body=body, **extra)
        if stream:
            content, reasoning, finish, calls = "", "", None, {}
            for chunk in c.chat.completions.create(stream=True, **params):
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    reasoning += getattr(ch.delta, "reasoning", None) or ""
                    finish = ch.finish_reason or finish
                    for d in ch.delta.tool_calls or []:
                        calls.setdefault(d.index, ["", ""])
                        calls[d.index][0] = d.function.name or calls[d.index][0]
                        calls[d.index][1] += d.function.arguments or ""
            calls = [(n, a) for n, a in calls.values()]
        else:
            r = c.chat.completions.create(**params)
            m = r.choices[0].message
            content, reasoning, finish = m.content or "", getattr(m, "reasoning", None) or "", r.choices[0].finish_reason
            assert (getattr(m, "reasoning_content", None) or "") == reasoning, "reasoning_content is reasoning's alias"
            calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
        if mode == "disabled":
            assert reasoning == "", (name, "the prompt closed the reasoning", reasoning)
        else:
            assert reasoning, (name, how, "the steered model reasons")
        check(content, calls, finish)
        out["outcomes"].append({"constraint": name, "steer": how, "stream": stream, "finish": finish, "reasoning_chars": len(reasoning),
                                "content": content, "calls": len(calls)})

    def pet(content, calls, finish):
        assert finish == "stop", (finish, content)
        Pet.model_validate_json(content)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}

    def called(content, calls, finish):
        # A call cut by max_tokens is returned as far as it went.
        assert finish in ("tool_calls", "length") and calls and content == "", (finish, calls, content)
        for name, args in calls:
            a = json.loads(args)
            if finish == "tool_calls":
                assert name == "get_weather" and isinstance(a["city"], str) and len(a["city"]) <= 6 and isinstance(a["days"], int), a

    for stream in (False, True):
        ask("json_schema", "never_closes", pet, stream, response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": dict(Pet.model_json_schema(), additionalProperties=False)}})
        ask("tool_required", "never_closes", called, stream, tools=[weather], tool_choice="required", max_tokens=400)
    # parse() gives the Pydantic object.
    r = c.chat.completions.parse(model=model, messages=msgs, response_format=Pet, max_tokens=100, temperature=1.0, seed=11,
                                 logit_bias=steer["never_closes"], extra_body=kw)
    assert isinstance(r.choices[0].message.parsed, Pet), r.choices[0].message
    if mode != "disabled":
        # An explicit budget: the reasoning closes after exactly that many
        # tokens (the tag is the next token in the logprobs).
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=1.0, seed=5, logprobs=True,
                                      logit_bias=steer["never_closes"], extra_body=dict(kw, thinking_token_budget=7,
                                      structured_outputs={"choice": ["yes", "no"]}))
        toks = [t.token for t in r.choices[0].logprobs.content]
        opened = 1 if mode == "adaptive" else 0
        assert toks[opened + 7] == "</mm:think>" and "</mm:think>" not in toks[:opened + 7], toks
        assert r.choices[0].message.content in ("yes", "no"), r.choices[0].message
        # A budget past max_tokens: the answer runs out inside the
        # reasoning, says so, and shows no unconstrained content.
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=1.0, seed=5,
                                      logit_bias=steer["never_closes"], extra_body=dict(kw, thinking_token_budget=100,
                                      structured_outputs={"regex": "[0-9]{3}"}))
        ch = r.choices[0]
        assert ch.finish_reason == "length" and not ch.message.content and ch.message.reasoning, ch
        out["capped"] = {"finish": ch.finish_reason, "reasoning_chars": len(ch.message.reasoning)}
    # vLLM's return_tokens_as_token_ids.
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=1.0, seed=1, logprobs=True, top_logprobs=2,
                                  extra_body=dict(kw, return_tokens_as_token_ids=True))
    for t in r.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", t.token) and bytes(t.bytes) == t.token.encode(), t
        assert all(re.fullmatch(r"token_id:\d+", x.token) for x in t.top_logprobs), t
    return out


def media_fetch(base, model, urls):
    """One image chat per URL (thinking disabled, greedy): each answer's
    HTTP status, and its text or its error's message and param."""
    h = httpx.Client(timeout=120)
    out = []
    for url in urls:
        body = {"model": model, "max_tokens": 4, "temperature": 0, "chat_template_kwargs": {"thinking_mode": "disabled"},
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
        r = h.post(base + "/chat/completions", json=body)
        j = r.json()
        if r.status_code == 200:
            out.append({"url": url, "status": 200, "text": j["choices"][0]["message"]["content"]})
        else:
            out.append({"url": url, "status": r.status_code, "message": j["error"]["message"], "param": j["error"]["param"]})
    return out


# Each subcommand: its function and how it reads its arguments.
COMMANDS = {
    "complete": lambda base, model, rest: complete(base, model, rest[0], json.loads(rest[1])),
    "chat": lambda base, model, rest: chat(base, model, rest[0], json.loads(rest[1])),
    "concurrent": lambda base, model, rest: asyncio.run(concurrent(base, model, int(rest[0]), int(rest[1]))),
    "load": lambda base, model, rest: asyncio.run(load(base, model, int(rest[0]), int(rest[1]))),
    "fault_streams": lambda base, model, rest: asyncio.run(fault_streams(base, model, int(rest[0]), int(rest[1]), int(rest[2]), *rest[3:4])),
    "disconnect": lambda base, model, rest: disconnect(base, model),
    "tools": lambda base, model, rest: tools(base, model),
    "shared_prefix": lambda base, model, rest: asyncio.run(shared_prefix(base, model, int(rest[0]))),
    "spec_streams": lambda base, model, rest: asyncio.run(spec_streams(base, model, int(rest[0]), int(rest[1]))),
    "errors": lambda base, model, rest: errors(base, model),
    "auth": lambda base, model, rest: auth(base, model, rest[0]),
    "busy": lambda base, model, rest: busy(base, model),
    "poison": lambda base, model, rest: poison(base, model),
    "stream": lambda base, model, rest: stream_until_end(base, model),
    "images": lambda base, model, rest: images(base, model, rest[0], rest[1], rest[2]),
    "video": lambda base, model, rest: video(base, model, rest[0], rest[1]),
    "image_chat": lambda base, model, rest: image_chat(base, model, rest[0], rest[1]),
    "responses": lambda base, model, rest: responses(base, model, rest[0], rest[1]),
    "structured": lambda base, model, rest: structured(base, model, *rest),
    "forced_tools": lambda base, model, rest: forced_tools(base, model, *rest),
    "chat_constraints": lambda base, model, rest: chat_constraints(base, model, rest[0]),
    "media_fetch": lambda base, model, rest: media_fetch(base, model, rest),
    "logprobs": lambda base, model, rest: logprobs(base, model),
    "prompt_logprobs": lambda base, model, rest: prompt_logprobs(base, model),
    "penalties": lambda base, model, rest: penalties(base, model, json.loads(rest[0]), json.loads(rest[1])),
    "choices": lambda base, model, rest: choices_and_tokens(base, model, json.loads(rest[0]), int(rest[1])),
}


def main():
    base, model, cmd, *rest = sys.argv[1:]
    if cmd not in COMMANDS:
        raise SystemExit(f"unknown subcommand {cmd}")
    print(json.dumps(COMMANDS[cmd](base, model, rest)))


if __name__ == "__main__":
    main()
