//! vLLM's KV-cache events (`--kv-events-config`), for routers that route by
//! what each replica's prefix cache holds (vllm-router's `kv_aware`,
//! llm-d, Dynamo). The first stage reports each block it stores in the
//! prefix cache and each one it evicts (`--kv-events`); they are published
//! here in vLLM's framing: a ZeroMQ PUB socket, each message three frames
//! (topic, sequence number as 8 big-endian bytes, a msgpack `[timestamp,
//! [event, ...], data_parallel_rank]` batch). Each event is a map tagged by
//! `type`, the layout vllm-router reads (0.1.17 refuses the positional
//! arrays that msgspec's `array_like` structs of older vLLMs write):
//!
//! - `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids`,
//!   `block_size`, `lora_id`, `medium`, `lora_name`;
//! - `BlockRemoved`: `block_hashes`, `medium`;
//! - `AllBlocksCleared`: sent when the pipeline starts (its pool is empty).
//!
//! Hashes are m3c's block hashes (32 bytes: the chain of the block's
//! token ids and image contents). With a `replay_endpoint`, a ROUTER socket
//! answers `["", start_seq]` with every kept batch from `start_seq` on
//! (`["", seq, payload]` each), then `["", -1, ""]`, as vLLM's publisher
//! does, for subscribers that join late or missed a sequence number.

use m3c_contract::blocks::BlockHash;
use m3c_contract::protocol::Event;
use rmpv::Value;
use std::collections::VecDeque;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend};

/// vLLM's `KVEventsConfig`, as `--kv-events-config` takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// Where the PUB socket binds (vLLM's default `tcp://*:5557`).
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// The replica's data-parallel rank, with several (`None`: one pipeline).
    pub rank: Option<usize>,
}

impl KvEventsConfig {
    /// Reads vLLM's JSON; `None` when events are off (`enable_kv_cache_events`
    /// false, or `publisher: "null"`). Every key is known or an error.
    pub fn from_json(text: &str) -> Result<Option<KvEventsConfig>, String> {
        const FLAG: &str = "--kv-events-config";
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("{FLAG}: not JSON ({e})"))?;
        let o = v.as_object().ok_or_else(|| format!("{FLAG}: expected a JSON object"))?;
        const KNOWN: &[&str] =
            &["enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"];
        if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(format!("{FLAG}: unknown key `{k}`; known: {}", KNOWN.join(", ")));
        }
        let text_of = |k: &str, default: &str| match o.get(k) {
            None | Some(serde_json::Value::Null) => Ok(default.to_string()),
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("{FLAG}: `{k}` must be a string")),
        };
        let enabled = match o.get("enable_kv_cache_events") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(_) => return Err(format!("{FLAG}: `enable_kv_cache_events` must be true or false")),
        };
        let publisher = text_of("publisher", "zmq")?;
        match publisher.as_str() {
            "zmq" => {}
            "null" => return Ok(None),
            p => return Err(format!("{FLAG}: publisher `{p}`: m3c publishes over `zmq` (or `null`: none)")),
        }
        if !enabled {
            return Ok(None);
        }
        let endpoint = bindable(&text_of("endpoint", "tcp://*:5557")?)?;
        let replay_endpoint = match o.get("replay_endpoint") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(bindable(s)?),
            Some(_) => return Err(format!("{FLAG}: `replay_endpoint` must be a string")),
        };
        let buffer_steps = match o.get("buffer_steps") {
            None | Some(serde_json::Value::Null) => 10_000,
            Some(v) => v
                .as_u64()
                .filter(|&n| (1..=1_000_000).contains(&n))
                .ok_or_else(|| format!("{FLAG}: `buffer_steps` must be 1 to 1000000"))? as usize,
        };
        Ok(Some(KvEventsConfig { endpoint, replay_endpoint, topic: text_of("topic", "")?, buffer_steps, rank: None }))
    }

    /// Replica `r`'s events (`--data-parallel-size`), as vLLM publishes a
    /// data-parallel rank's: on the endpoints' ports plus `r`, each batch
    /// carrying `r` as its `data_parallel_rank`.
    pub fn for_rank(&self, r: usize) -> Result<KvEventsConfig, String> {
        let offset = |ep: &str| -> Result<String, String> {
            let (base, port) = ep.rsplit_once(':').ok_or_else(|| format!("--kv-events-config: endpoint `{ep}` has no port"))?;
            let port = port
                .parse::<usize>()
                .ok()
                .map(|p| p + r)
                .filter(|&p| p <= 65_535)
                .ok_or_else(|| format!("--kv-events-config: endpoint `{ep}`: replica {r} would publish past port 65535"))?;
            Ok(format!("{base}:{port}"))
        };
        Ok(KvEventsConfig {
            endpoint: offset(&self.endpoint)?,
            replay_endpoint: self.replay_endpoint.as_deref().map(offset).transpose()?,
            rank: Some(r),
            ..self.clone()
        })
    }
}

/// A TCP endpoint to bind (`tcp://*:PORT` is every interface, as ZeroMQ reads it).
fn bindable(endpoint: &str) -> Result<String, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("--kv-events-config: endpoint `{endpoint}`: m3c binds TCP endpoints (`tcp://HOST:PORT`)"))?;
    let rest = rest.strip_prefix("*:").map_or_else(|| rest.to_string(), |port| format!("0.0.0.0:{port}"));
    match rest.rsplit_once(':') {
        Some((_, port)) if port.parse::<u16>().is_ok() => Ok(format!("tcp://{rest}")),
        _ => Err(format!("--kv-events-config: endpoint `{endpoint}` has no port")),
    }
}

/// One event in vLLM's tagged-map form (`None`: not a KV-cache event).
pub fn event_value(e: &Event, block_size: usize) -> Option<Value> {
    let hash = |h: &BlockHash| Value::Binary(h.0.to_vec());
    let map = |pairs: Vec<(&str, Value)>| Value::Map(pairs.into_iter().map(|(k, v)| (Value::from(k), v)).collect());
    match e {
        Event::BlockStored { parent, hash: h, tokens } => Some(map(vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", Value::Array(vec![hash(h)])),
            ("parent_block_hash", parent.as_ref().map_or(Value::Nil, hash)),
            ("token_ids", Value::Array(tokens.iter().map(|&t| Value::from(t)).collect())),
            ("block_size", Value::from(block_size as u64)),
            ("lora_id", Value::Nil),
            // m3c's one pool is the primary tier, vLLM's "GPU" (a host
            // build's too): not an offload tier a router would discount.
            ("medium", Value::from("GPU")),
            ("lora_name", Value::Nil),
        ])),
        Event::BlocksRemoved { hashes } => Some(map(vec![
            ("type", Value::from("BlockRemoved")),
            ("block_hashes", Value::Array(hashes.iter().map(hash).collect())),
            ("medium", Value::from("GPU")),
        ])),
        _ => None,
    }
}

/// The `AllBlocksCleared` event.
pub fn cleared() -> Value {
    Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared"))])
}

/// A batch's msgpack payload: `[timestamp, events, data_parallel_rank]`.
pub fn batch_payload(events: Vec<Value>, ts: f64, rank: Option<usize>) -> Vec<u8> {
    let mut out = Vec::new();
    let rank = rank.map_or(Value::Nil, |r| Value::from(r as u64));
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::from(ts), Value::Array(events), rank]));
    out
}

/// The publisher's handle: events go to its task, which batches what has
/// arrived and sends it.
pub struct Publisher {
    tx: mpsc::UnboundedSender<Value>,
    block_size: usize,
}

impl Publisher {
    /// Binds the sockets (an error names the endpoint) and starts the task.
    pub async fn start(cfg: KvEventsConfig, block_size: usize) -> anyhow::Result<Publisher> {
        let mut publish = zeromq::PubSocket::new();
        publish.bind(&cfg.endpoint).await.map_err(|e| anyhow::anyhow!("--kv-events-config: cannot bind {}: {e}", cfg.endpoint))?;
        let replay = match &cfg.replay_endpoint {
            Some(ep) => {
                let mut r = zeromq::RouterSocket::new();
                r.bind(ep).await.map_err(|e| anyhow::anyhow!("--kv-events-config: cannot bind the replay endpoint {ep}: {e}"))?;
                Some(r)
            }
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(publish, replay, rx, cfg));
        Ok(Publisher { tx, block_size })
    }

    /// A stage event, when it is a KV-cache event.
    pub fn publish(&self, e: &Event) {
        if let Some(v) = event_value(e, self.block_size) {
            let _ = self.tx.send(v);
        }
    }

    /// The pool is empty (the pipeline started).
    pub fn all_cleared(&self) {
        let _ = self.tx.send(cleared());
    }
}

/// The batches kept for replay, by sequence number.
type Kept = std::sync::Arc<std::sync::Mutex<VecDeque<(i64, bytes::Bytes)>>>;

/// How long one replay message may wait on a client that does not read.
const REPLAY_SEND: std::time::Duration = std::time::Duration::from_secs(5);

async fn run(
    mut publish: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    mut rx: mpsc::UnboundedReceiver<Value>,
    cfg: KvEventsConfig,
) {
    let kept: Kept = Default::default();
    // Replay answers from a task of its own: a client that stops reading
    // must not hold up the live events (PUB itself never waits: a slow
    // subscriber's messages are dropped, as ZeroMQ does).
    if let Some(r) = replay {
        tokio::spawn(serve_replay(r, kept.clone()));
    }
    let mut seq: i64 = 0;
    while let Some(first) = rx.recv().await {
        // One batch: the event that woke the task and whatever came with it.
        let mut events = vec![first];
        while let Ok(v) = rx.try_recv() {
            events.push(v);
        }
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let payload = bytes::Bytes::from(batch_payload(events, ts, cfg.rank));
        let frames =
            vec![bytes::Bytes::from(cfg.topic.clone().into_bytes()), bytes::Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        if let Ok(m) = zeromq::ZmqMessage::try_from(frames) {
            let _ = publish.send(m).await;
        }
        if cfg.replay_endpoint.is_some() {
            let mut k = kept.lock().unwrap_or_else(|e| e.into_inner());
            k.push_back((seq, payload));
            while k.len() > cfg.buffer_steps {
                k.pop_front();
            }
        }
        seq += 1;
    }
}

/// Answers replay requests (`[identity, "", start_seq]`) with the kept
/// batches from `start_seq` on, then sequence −1; a client that does not
/// read within [`REPLAY_SEND`] loses the rest of its answer.
async fn serve_replay(mut r: zeromq::RouterSocket, kept: Kept) {
    while let Ok(m) = r.recv().await {
        let frames = m.into_vec();
        let (Some(id), Some(start)) = (frames.first().cloned(), frames.last()) else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(i64::from_be_bytes) else { continue };
        let batches: Vec<(i64, bytes::Bytes)> =
            kept.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|(s, _)| *s >= start).cloned().collect();
        let empty = bytes::Bytes::new();
        let end = (-1i64, empty.clone());
        for (seq, payload) in batches.into_iter().chain(std::iter::once(end)) {
            let reply = vec![id.clone(), empty.clone(), bytes::Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
            let Ok(m) = zeromq::ZmqMessage::try_from(reply) else { break };
            if !matches!(tokio::time::timeout(REPLAY_SEND, r.send(m)).await, Ok(Ok(()))) {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllms_config_is_read_and_checked() {
        assert_eq!(KvEventsConfig::from_json(r#"{"enable_kv_cache_events": false}"#), Ok(None));
        assert_eq!(KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#), Ok(None));
        let c =
            KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}"#)
                .unwrap()
                .unwrap();
        assert_eq!((c.endpoint.as_str(), c.topic.as_str(), c.replay_endpoint), ("tcp://0.0.0.0:5557", "kv", None));
        for (bad, says) in [
            (r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#, "publisher `kafka`"),
            (r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}"#, "TCP"),
            (r#"{"enable_kv_cache_events": true, "endpoint": "tcp://host"}"#, "no port"),
            (r#"{"enable_kv_cache_events": true, "colour": 1}"#, "unknown key `colour`"),
            ("[1]", "JSON object"),
        ] {
            let e = KvEventsConfig::from_json(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn each_replica_publishes_on_the_ports_plus_its_rank() {
        let c =
            KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}"#)
                .unwrap()
                .unwrap();
        let r2 = c.for_rank(2).unwrap();
        assert_eq!(
            (r2.endpoint.as_str(), r2.replay_endpoint.as_deref(), r2.rank),
            ("tcp://0.0.0.0:5559", Some("tcp://0.0.0.0:5602"), Some(2))
        );
        let payload = batch_payload(vec![cleared()], 1.0, r2.rank);
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        assert_eq!(v.as_array().unwrap()[2].as_u64(), Some(2));
        let high = KvEventsConfig { endpoint: "tcp://0.0.0.0:65535".into(), ..c };
        assert!(high.for_rank(1).unwrap_err().contains("past port 65535"));
    }

    #[test]
    fn events_are_vllms_tagged_maps_in_a_batch() {
        let stored = Event::BlockStored { parent: Some(BlockHash([1; 32])), hash: BlockHash([2; 32]), tokens: vec![5, 6, 7, 8] };
        let removed = Event::BlocksRemoved { hashes: vec![BlockHash([2; 32])] };
        let events = vec![event_value(&stored, 4).unwrap(), event_value(&removed, 4).unwrap(), cleared()];
        assert_eq!(event_value(&Event::Ready, 4), None);
        let payload = batch_payload(events, 12.5, None);
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let batch = v.as_array().unwrap();
        assert_eq!((batch[0].as_f64(), batch[2].is_nil()), (Some(12.5), true));
        let field = |e: &Value, k: &str| e.as_map().unwrap().iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
        let evs = batch[1].as_array().unwrap();
        assert_eq!(field(&evs[0], "type").unwrap().as_str(), Some("BlockStored"));
        assert_eq!(field(&evs[0], "token_ids").unwrap(), Value::Array(vec![5.into(), 6.into(), 7.into(), 8.into()]));
        assert_eq!(field(&evs[0], "parent_block_hash").unwrap(), Value::Binary(vec![1; 32]));
        assert_eq!(field(&evs[0], "block_size").unwrap().as_u64(), Some(4));
        for k in ["lora_id", "lora_name"] {
            assert!(field(&evs[0], k).is_some_and(|v| v.is_nil()), "{k}");
        }
        assert_eq!(field(&evs[1], "type").unwrap().as_str(), Some("BlockRemoved"));
        assert_eq!(field(&evs[1], "block_hashes").unwrap(), Value::Array(vec![Value::Binary(vec![2; 32])]));
        assert_eq!(field(&evs[2], "type").unwrap().as_str(), Some("AllBlocksCleared"));
    }
}
