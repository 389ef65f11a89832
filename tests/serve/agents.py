"""Agents' tests of `m3c serve`, as agent frameworks see it: OpenAI's and
Anthropic's official Python clients, whose stream helpers accumulate tool
calls' arguments, against a running server on random weights. Prints what
it saw as JSON on stdout; exits non-zero (with the reason) when an answer
breaks a rule.

    python agents.py BASE_URL MODEL sweep SEEDS
    python agents.py BASE_URL MODEL corpus CORPUS.json
"""

import asyncio
import json
import sys
from typing import Literal, Optional

import anthropic
import openai
from pydantic import BaseModel, ConfigDict, Field

MARK = "]<]minimax[>["
MARKUP = ("<tool_call", "</tool_call", "<invoke", "</invoke", MARK, "<mm:think>", "</mm:think>")
MODES = ("adaptive", "enabled", "disabled")


def clients(base):
    o = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    a = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=600)
    return o, a


def as_anthropic(tool):
    f = tool["function"]
    return {"name": f["name"], "description": f.get("description", ""), "input_schema": f["parameters"]}


def no_markup(where, content):
    assert not any(m in content for m in MARKUP), (where, "markup in the content", content)


def strict(tools):
    """The tools as the stream helper takes them (it parses only `strict` ones)."""
    return [dict(t, function=dict(t["function"], strict=True)) for t in tools]


async def openai_stream(o, **kw):
    """One streamed chat through the client's stream helper: the final
    completion it accumulated, and what the raw chunks said (reasoning,
    content, and each call's name and argument fragments)."""
    if "tools" in kw:
        kw["tools"] = strict(kw["tools"])
    reasoning, content, calls, finish = "", "", {}, None
    try:
        async with o.chat.completions.stream(**kw) as s:
            async for ev in s:
                if ev.type != "chunk":
                    continue
                for ch in ev.chunk.choices:
                    finish = ch.finish_reason or finish
                    d = ch.delta
                    reasoning += getattr(d, "reasoning", None) or ""
                    content += d.content or ""
                    for t in d.tool_calls or []:
                        c = calls.setdefault(t.index, {"id": None, "name": None, "fragments": []})
                        if t.id:
                            assert c["id"] is None and t.function.name, ("a call's first delta names it, once", t)
                            c["id"], c["name"] = t.id, t.function.name
                        if t.function and t.function.arguments:
                            c["fragments"].append(t.function.arguments)
            final = await s.get_final_completion()
    except openai.LengthFinishReasonError as e:
        # The helper will not parse a cut answer; what it had is the answer.
        final, finish = e.completion, "length"
    m = final.choices[0].message
    helper = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    raw = [(calls[i]["name"], "".join(calls[i]["fragments"])) for i in sorted(calls)]
    assert helper == raw, ("the helper's calls are the deltas'", helper, raw)
    assert (m.content or "") == content, (m.content, content)
    return {"reasoning": reasoning, "content": content, "calls": raw, "finish": finish,
            "fragments": [len(calls[i]["fragments"]) for i in sorted(calls)], "ids": [calls[i]["id"] for i in sorted(calls)]}


async def openai_whole(o, **kw):
    if "tools" in kw:
        kw["tools"] = strict(kw["tools"])
    r = await o.chat.completions.create(**kw)
    m = r.choices[0].message
    reasoning = getattr(m, "reasoning", None) or ""
    assert (getattr(m, "reasoning_content", None) or "") == reasoning
    return {"reasoning": reasoning, "content": m.content or "", "calls": [(t.function.name, t.function.arguments) for t in m.tool_calls or []],
            "finish": r.choices[0].finish_reason, "ids": [t.id for t in m.tool_calls or []]}


def items_read(r):
    reasoning = "".join(c.text for item in r.output if item.type == "reasoning" for c in item.content or [])
    text = "".join(c.text for item in r.output if item.type == "message" for c in item.content)
    return {"reasoning": reasoning, "content": text, "calls": [], "finish": "stop" if r.status == "completed" else "length"}


async def responses_whole(o, **kw):
    return items_read(await o.responses.create(**kw))


async def responses_stream(o, **kw):
    """The Responses stream through the client's helper: the deltas it saw
    add up to its final response."""
    reasoning, text = "", ""
    async with o.responses.stream(**kw) as s:
        async for ev in s:
            if ev.type == "response.reasoning_text.delta":
                reasoning += ev.delta
            elif ev.type == "response.output_text.delta":
                text += ev.delta
        final = await s.get_final_response()
    got = items_read(final)
    assert (got["reasoning"], got["content"]) == (reasoning, text), (got, reasoning, text)
    return got


def blocks_read(content, stop_reason):
    reasoning = "".join(b.thinking for b in content if b.type == "thinking")
    text = "".join(b.text for b in content if b.type == "text")
    calls = [(b.name, json.dumps(b.input)) for b in content if b.type == "tool_use"]
    finish = {"tool_use": "tool_calls", "end_turn": "stop", "max_tokens": "length"}[stop_reason]
    return {"reasoning": reasoning, "content": text, "calls": calls, "finish": finish}


async def anthropic_whole(a, **kw):
    r = await a.messages.create(**kw)
    out = blocks_read(r.content, r.stop_reason)
    out["blocks"] = [b.model_dump() for b in r.content]
    return out


async def anthropic_stream(a, **kw):
    """One streamed message through the client's stream helper: what its
    final message says, and each tool use's count of input_json_delta events."""
    fragments = {}
    async with a.messages.stream(**kw) as s:
        async for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                fragments[ev.index] = fragments.get(ev.index, 0) + 1
        final = await s.get_final_message()
    out = blocks_read(final.content, final.stop_reason)
    out["blocks"] = [b.model_dump() for b in final.content]
    out["fragments"] = [fragments.get(i, 0) for i, b in enumerate(final.content) if b.type == "tool_use"]
    return out


# --- Sampled constraints: every answer holds, whatever the draws. ---------

class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    hourly: bool
    threshold: Optional[float] = None


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=6)
    days: int = Field(ge=1, le=14)
    unit: Optional[Literal["c", "f"]] = None
    options: Optional[Options] = None


class Search(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    query: str = Field(min_length=1, max_length=5, pattern=r"^[a-z ]+$")


class Pet(BaseModel):
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)
    tame: bool


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]},
        "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}, "threshold": {"type": "number"}}, "required": ["hourly"]},
    },
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 5, "pattern": "^[a-z ]+$"}}, "required": ["query"]}}}
MODELS = {"get_weather": Weather, "search": Search}


def judged(kind, got, single=None):
    """`valid` or `length`; anything else fails the test."""
    no_markup(kind, got["content"])
    if kind == "schema":
        if got["finish"] == "length":
            return "length"
        assert got["finish"] == "stop", (kind, got)
        Pet.model_validate_json(got["content"])
        return "valid"
    if got["finish"] == "length":
        for _, args in got["calls"]:
            json.loads(args)  # a cut call still closes as JSON
        return "length"
    assert got["finish"] == "tool_calls" and got["calls"] and got["content"] == "", (kind, got)
    for name, args in got["calls"]:
        MODELS[name].model_validate_json(args)
    assert single is None or [n for n, _ in got["calls"]] == [single], (kind, got)
    return "valid"


async def sweep(base, model, seeds):
    """Forced calls and schemas at temperature 1 over `seeds` seeds in every
    thinking mode, without logit steering, through both clients (whole and
    streamed in turn): every answer is a valid call or valid JSON, or ends
    in finish `length`."""
    o, a = clients(base)
    gate = asyncio.Semaphore(48)
    msgs = [{"role": "user", "content": "Weather in Paris? Then a pet as JSON."}]
    pet = {"type": "json_schema", "json_schema": {"name": "pet", "schema": dict(Pet.model_json_schema(), additionalProperties=False)}}
    tools = [WEATHER, SEARCH]
    named = {"type": "function", "function": {"name": "search"}}

    async def one(mode, seed, what):
        # Reasoning is capped at 48 tokens; a call on random weights takes
        # some 200 (its tags are many tokens of the tiny vocabulary).
        kw = dict(model=model, max_tokens=320)
        chat = dict(kw, messages=msgs, temperature=1.0, seed=seed,
                    extra_body={"chat_template_kwargs": {"thinking_mode": mode}, "thinking_token_budget": 48})
        thinking = {"type": mode, "budget_tokens": 48} if mode != "disabled" else {"type": mode}
        messages = dict(kw, messages=msgs, thinking=thinking, extra_body={"temperature": 1.0, "seed": seed})
        async with gate:
            if what == "schema":
                got = await (openai_stream if seed % 2 else openai_whole)(o, response_format=pet, **chat)
                return mode, what, judged("schema", got)
            way = seed % 4
            if way == 0:
                got = await openai_whole(o, tools=tools, tool_choice="required", **chat)
            elif way == 1:
                got = await openai_stream(o, tools=tools, tool_choice=named, **chat)
                return mode, what, judged("tools", got, "search")
            elif way == 2:
                got = await anthropic_whole(a, tools=[as_anthropic(t) for t in tools], tool_choice={"type": "any"}, **messages)
            else:
                got = await anthropic_stream(a, tools=[as_anthropic(t) for t in tools], tool_choice={"type": "tool", "name": "get_weather"}, **messages)
                return mode, what, judged("tools", got, "get_weather")
            return mode, what, judged("tools", got)

    jobs = [one(mode, seed, what) for mode in MODES for seed in range(seeds) for what in ("tools", "schema")]
    tally = {}
    for mode, what, verdict in await asyncio.gather(*jobs):
        t = tally.setdefault(mode, {}).setdefault(what, {"valid": 0, "length": 0})
        t[verdict] += 1
    return {"seeds": seeds, "tally": tally}


# --- The corpus: chosen outputs, whole and streamed, through both clients. -

async def corpus(base, model, path):
    """Each corpus case written by the model (a `structured_outputs` choice
    of its exact text, beside the tools, with a server whose grammar binds
    the reasoning too), read by OpenAI's and Anthropic's clients whole and
    streamed: the same reasoning, content and calls each way, as the corpus
    says; no markup in the content; every call's arguments in more than one
    delta."""
    o, a = clients(base)
    c = json.load(open(path))
    gate = asyncio.Semaphore(16)
    msgs = [{"role": "user", "content": "Go."}]

    async def one(case):
        text = case["text"].replace(c["mark"], MARK)
        tools = [c["tools"][n] for n in case["tools"]]
        want_calls = [(k["name"], k["arguments"]) for k in case["calls"]]
        want = {"reasoning": case["reasoning"].replace(c["mark"], MARK), "content": case["content"].replace(c["mark"], MARK),
                "finish": "tool_calls" if want_calls else "stop"}
        so = {"choice": [text]}
        chat = dict(model=model, messages=msgs, tools=tools, max_tokens=800, temperature=0,
                    extra_body={"structured_outputs": so, "chat_template_kwargs": {"thinking_mode": case["think"]}})
        messages = dict(model=model, messages=msgs, tools=[as_anthropic(t) for t in tools], max_tokens=800, thinking={"type": case["think"]},
                        extra_body={"temperature": 0, "structured_outputs": so})
        # Special tokens kept in the text change nothing here.
        chat_specials = dict(chat, extra_body=dict(chat["extra_body"], skip_special_tokens=False))
        async with gate:
            seen = {
                "openai": await openai_whole(o, **chat),
                "openai stream": await openai_stream(o, **chat),
                "openai stream, special tokens kept": await openai_stream(o, **chat_specials),
                "anthropic": await anthropic_whole(a, **messages),
                "anthropic stream": await anthropic_stream(a, **messages),
            }
            if not want_calls and MARK not in text and "<tool_call>" not in text and "<invoke" not in text:
                # The Responses API (which offers no tools) reads reasoning the same.
                responses = dict(model=model, input="Go.", max_output_tokens=800, temperature=0,
                                 extra_body={"structured_outputs": so, "chat_template_kwargs": {"thinking_mode": case["think"]}})
                seen["responses"] = await responses_whole(o, **responses)
                seen["responses stream"] = await responses_stream(o, **responses)
        for way, got in seen.items():
            where = (case["name"], way)
            no_markup(where, got["content"])
            for k in ("reasoning", "content", "finish"):
                assert got[k] == want[k], (where, k, got[k], want[k])
            calls = [(n, json.loads(args)) for n, args in got["calls"]]
            assert calls == want_calls, (where, calls, want_calls)
            for (n, args), frags in zip(want_calls, got.get("fragments", [2] * len(want_calls))):
                assert args == {} or frags > 1, (where, n, "arguments in one delta", frags)
        for way in ("openai", "openai stream"):
            ids = seen[way]["ids"]
            assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids), (case["name"], way, ids)
        # Anthropic's blocks, in order, are the same whole and streamed (ids aside).
        shape = lambda bs: [{k: v for k, v in b.items() if k != "id"} for b in bs]
        assert shape(seen["anthropic"]["blocks"]) == shape(seen["anthropic stream"]["blocks"]), (case["name"], seen["anthropic"]["blocks"])
        got = seen["openai"]
        return {"case": case["name"], "calls": [n for n, _ in got["calls"]], "content": got["content"], "finish": got["finish"],
                "fragments": seen["openai stream"]["fragments"]}

    rows = await asyncio.gather(*[one(case) for case in c["cases"]])
    return {"cases": len(rows), "rows": rows}


def main():
    base, model, cmd, *rest = sys.argv[1:]
    if cmd == "sweep":
        out = asyncio.run(sweep(base, model, int(rest[0])))
    elif cmd == "corpus":
        out = asyncio.run(corpus(base, model, rest[0]))
    else:
        raise SystemExit(f"unknown subcommand {cmd}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
