"""A KV-cache event subscriber, as a router's would be: pyzmq and msgpack
against `m3c serve --kv-events-config`. It prints one JSON line per event
as it arrives (`{"seq", "type", "hashes", "parent", "tokens",
"block_size"}`, hashes in hex) until stdin closes, then asks the replay
socket for everything from sequence 0 and prints
`{"replayed": N, "types": [...]}`.

    python kv_events_sub.py PUB_ENDPOINT REPLAY_ENDPOINT
"""

import json
import sys
import threading

import msgpack
import zmq


def events(payload):
    ts, evs, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and rank is None, (ts, rank)
    for e in evs:
        yield e


def describe(seq, e):
    hexes = lambda hs: [h.hex() if isinstance(h, bytes) else str(h) for h in hs]
    out = {"seq": seq, "type": e["type"]}
    if e["type"] == "BlockStored":
        assert set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}, e
        out.update(hashes=hexes(e["block_hashes"]), tokens=e["token_ids"], block_size=e["block_size"])
        out["parent"] = None if e["parent_block_hash"] is None else e["parent_block_hash"].hex()
    elif e["type"] == "BlockRemoved":
        assert set(e) == {"type", "block_hashes", "medium"}, e
        out["hashes"] = hexes(e["block_hashes"])
    return out


def main(pub, replay):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    print(json.dumps({"subscribed": True}), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not done.is_set():
        if not poller.poll(100):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"", topic
        seq = int.from_bytes(seq, "big", signed=True)
        for e in events(payload):
            print(json.dumps(describe(seq, e)), flush=True)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10000)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
    replayed, types = 0, []
    while True:
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        replayed += 1
        types.extend(e["type"] for e in events(payload))
    print(json.dumps({"replayed": replayed, "types": types}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
