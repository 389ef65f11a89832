"""A workload through a router, as a user's program: OpenAI's Python client
sends chats and completions (whole and streamed, greedy and seeded) with a
shared system prompt, and prints every answer's text as JSON on stdout.
The Rust side (tests/it/routers.rs) runs it against a router in front of
m3c replicas and against one replica alone, and compares.

    python router_client.py BASE_URL MODEL
"""

import json
import sys

import openai

SYSTEM = "You are a careful assistant. " * 12


def main(base, model):
    c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    out = {}
    for i, user in enumerate(["Why is the sky blue?", "Name a prime.", "Why is the sky blue?", "What is MSA?"]):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        msg = r.choices[0].message
        out[f"chat {i}"] = [msg.content, getattr(msg, "reasoning", None), r.choices[0].finish_reason]
        text = ""
        for chunk in c.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0.8, seed=7 + i, stream=True
        ):
            for ch in chunk.choices:
                text += (ch.delta.content or "") + (getattr(ch.delta, "reasoning", None) or "")
        out[f"chat stream {i}"] = text
    for i, prompt in enumerate(["The capital of France is", "Once upon a time"]):
        r = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0.7, seed=3)
        out[f"completion {i}"] = [r.choices[0].text, r.choices[0].finish_reason]
        # A stop string kept in the text (vLLM's include_stop_str_in_output,
        # which a router's added `no_stop_trim: false` must not override).
        r = c.completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=0, stop=["e"], extra_body={"include_stop_str_in_output": True}
        )
        out[f"completion stop {i}"] = [r.choices[0].text, r.choices[0].finish_reason]
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
