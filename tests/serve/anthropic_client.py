"""m3c serve's Messages API (`/v1/messages`), as an agent's program sees it:
(this client's `create` no longer takes sampling fields; m3c, as vLLM,
reads `temperature` from the body, so the tests send it as extra body)
Anthropic's official Python client against a running `m3c serve`, and
OpenAI's client on the chat route beside it. Prints what it saw as JSON on
stdout; exits non-zero (with the reason) when the server misbehaves.

    python anthropic_client.py BASE_URL MODEL PNG
"""

import base64
import json
import sys

import anthropic
import openai
from pydantic import BaseModel, ConfigDict, Field


def main():
    base, model, png = sys.argv[1:]
    root = base.removesuffix("/v1")
    a = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=120)
    o = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    out = {}
    system = "You answer briefly."
    turns = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Count to three."}]
    off = {"thinking_mode": "disabled"}

    # The same text as the chat route for the same conversation and seed
    # (greedy), whole and streamed; usage and stop reasons agree.
    whole = a.messages.create(model=model, system=system, messages=turns, max_tokens=24, extra_body={"temperature": 0},
                              thinking={"type": "disabled"})
    chat = o.chat.completions.create(model=model, messages=[{"role": "system", "content": system}] + turns, max_tokens=24,
                                     temperature=0, extra_body={"chat_template_kwargs": off})
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)
    assert whole.usage.input_tokens == chat.usage.prompt_tokens, (whole.usage, chat.usage)
    assert whole.usage.output_tokens == chat.usage.completion_tokens, (whole.usage, chat.usage)
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason], whole.stop_reason
    with a.messages.stream(model=model, system=system, messages=turns, max_tokens=24, extra_body={"temperature": 0},
                           thinking={"type": "disabled"}) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.stop_reason == whole.stop_reason, (streamed, text, final.stop_reason)
    assert final.usage.output_tokens == whole.usage.output_tokens, (final.usage, whole.usage)
    out["text"], out["stop_reason"] = text, whole.stop_reason

    # Sampled with a seed-free request is not comparable; a stop sequence
    # cut from the greedy text ends the answer there, named.
    if len(text) > 6:
        stop = text[3:6]
        cut = a.messages.create(model=model, system=system, messages=turns, max_tokens=24, extra_body={"temperature": 0},
                                thinking={"type": "disabled"}, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, (cut.stop_reason, cut.stop_sequence)
        assert cut.content[0].text == text[:text.index(stop)], (cut.content, text, stop)
        out["stop_sequence"] = stop

    # Thinking: enabled, the model's reasoning comes as a thinking block
    # before the text (the stream rebuilds the same blocks).
    think = a.messages.create(model=model, messages=turns, max_tokens=40, extra_body={"temperature": 0},
                              thinking={"type": "enabled", "budget_tokens": 1024})
    kinds = [b.type for b in think.content]
    with a.messages.stream(model=model, messages=turns, max_tokens=40, extra_body={"temperature": 0},
                           thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        again = s.get_final_message()
    assert [b.type for b in again.content] == kinds and again.content == think.content, (again.content, think.content)
    out["thinking_blocks"] = kinds

    # A forced tool use validates against its schema; its result goes back
    # as a tool_result block and the conversation goes on.
    class Weather(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        city: str = Field(max_length=6)
        days: int

    tool = {"name": "get_weather", "description": "The forecast.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer"}},
                             "required": ["city", "days"]}}
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    used = a.messages.create(model=model, messages=asked, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
                             max_tokens=200, extra_body={"temperature": 1.0, "seed": 3}, thinking={"type": "disabled"})
    calls = [b for b in used.content if b.type == "tool_use"]
    assert used.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "get_weather", used.content
    Weather.model_validate(calls[0].input)
    # The same request streamed rebuilds the same call (seeded: the same draws).
    with a.messages.stream(model=model, messages=asked, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
                           max_tokens=200, extra_body={"temperature": 1.0, "seed": 3}, thinking={"type": "disabled"}) as s:
        streamed_use = s.get_final_message()
    # (Each answer's tool_use ids are its own: unique in the conversation.)
    same = lambda m: [b.model_dump(exclude={"id"}) for b in m.content]
    assert streamed_use.stop_reason == "tool_use" and same(streamed_use) == same(used), (streamed_use, used)
    assert streamed_use.content[0].id != used.content[0].id and used.content[0].id.startswith("toolu_"), (streamed_use, used)
    # `any`: some call, valid, from seeded draws.
    for seed in range(3):
        anyone = a.messages.create(model=model, messages=asked, tools=[tool], tool_choice={"type": "any"}, max_tokens=200,
                                   extra_body={"temperature": 1.0, "seed": seed}, thinking={"type": "disabled"})
        uses = [b for b in anyone.content if b.type == "tool_use"]
        # Cut by max_tokens, the last call is returned as far as it went.
        assert anyone.stop_reason in ("tool_use", "max_tokens") and uses, (seed, anyone)
        for b in uses if anyone.stop_reason == "tool_use" else uses[:-1]:
            Weather.model_validate(b.input)
    follow = asked + [{"role": "assistant", "content": [c.model_dump() for c in calls]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C."}]}]
    after = a.messages.create(model=model, messages=follow, tools=[tool], max_tokens=8, extra_body={"temperature": 0}, thinking={"type": "disabled"})
    assert after.content, after
    out["tool_input"] = calls[0].input

    # An image turn (base64) and its token count.
    data = base64.b64encode(open(png, "rb").read()).decode()
    image_turn = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                                               {"type": "text", "text": "What is this?"}]}]
    seen = a.messages.create(model=model, messages=image_turn, max_tokens=6, extra_body={"temperature": 0}, thinking={"type": "disabled"})
    counted = a.messages.count_tokens(model=model, messages=image_turn, thinking={"type": "disabled"})
    assert counted.input_tokens == seen.usage.input_tokens, (counted, seen.usage)
    out["image_input_tokens"] = counted.input_tokens

    # Errors in Anthropic's shape; unknown fields refused by name.
    for kw, says in [(dict(max_tokens=8, messages=turns, service_tier="auto"), "service_tier"),
                     (dict(max_tokens=8, messages=[{"role": "system", "content": "x"}]), "role `system`"),
                     (dict(max_tokens=8, messages=turns, tool_choice={"type": "maybe"}), "tool_choice")]:
        try:
            a.messages.create(model=model, **kw)
            raise AssertionError(f"{kw} was accepted")
        except anthropic.BadRequestError as e:
            body = e.response.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert says in body["error"]["message"], (says, body)
    try:
        a.messages.create(model="another", max_tokens=8, messages=turns)
        raise AssertionError("another model's name was accepted")
    except anthropic.APIStatusError as e:
        assert e.response.json()["type"] == "error", e.response.text
    print(json.dumps(out))


if __name__ == "__main__":
    main()
