//! The server's pipelines (`--data-parallel-size N`: N replicas of one
//! build, each an mpirun job of its own; one without the flag). A request
//! goes to one replica (`crate::route`); the server is healthy while any
//! replica is, and a replica whose pipeline stops is out of routing while
//! the others serve. Every replica gives a request the same tokens, so
//! where it runs changes only its speed.

use crate::engine::{Engine, SubmitError, Ticket, TraceError};
use crate::metrics::{Gauges, Scrape};
use crate::route;
use m3c_contract::blocks::BlockHash;
use m3c_contract::protocol::SeqRequest;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Replicas {
    pub engines: Vec<Arc<Engine>>,
    /// Positions per cache block (the prefix cache's unit).
    kv_block: usize,
    /// Route by prefix affinity (the prefix cache is on); else by load alone.
    by_prefix: bool,
    /// A replica keeps a prefix's requests until it is this many busier
    /// than the least busy one (a batch).
    slack: usize,
    /// One routing decision at a time, so that requests of one prefix
    /// arriving together see each other's choice.
    routing: Mutex<()>,
}

impl Replicas {
    pub fn new(engines: Vec<Arc<Engine>>, kv_block: usize, by_prefix: bool, slack: usize) -> Replicas {
        Replicas { engines, kv_block, by_prefix, slack, routing: Mutex::new(()) }
    }

    /// Admits a request on the replica [`route::pick`] chooses.
    pub fn submit(&self, request: SeqRequest) -> Result<Ticket, SubmitError> {
        if let [one] = &self.engines[..] {
            return one.submit(request);
        }
        let chain = if self.by_prefix { prompt_chain(&request.prompt, self.kv_block) } else { Vec::new() };
        let _one_at_a_time = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        let candidates: Vec<Option<route::Candidate>> = self
            .engines
            .iter()
            .map(|e| {
                let a = e.affinity.lock().unwrap_or_else(|p| p.into_inner());
                e.healthy().then(|| route::Candidate { load: e.load(), matched: a.matched(&chain), held: a.len() })
            })
            .collect();
        // None up: a replica that is restarting queues it (the least loaded),
        // as a lone pipeline does.
        let restarting = || {
            let heal = self.engines.iter().enumerate().filter(|(_, e)| e.restarting().is_some());
            heal.min_by_key(|(i, e)| (e.load(), *i)).map(|(i, _)| i)
        };
        let Some(r) = route::pick(&candidates, chain.len(), self.slack).or_else(restarting) else {
            return Err(SubmitError::Down(self.down_reason().unwrap_or_else(|| "the model is still loading".into())));
        };
        let ticket = self.engines[r].submit(request)?;
        self.engines[r].affinity.lock().unwrap_or_else(|p| p.into_inner()).routed(&chain);
        Ok(ticket)
    }

    /// Some replica takes requests.
    pub fn healthy(&self) -> bool {
        self.engines.iter().any(|e| e.healthy())
    }

    /// Why no replica takes requests (`None` while one does, or while
    /// they are still loading).
    pub fn down_reason(&self) -> Option<String> {
        if self.healthy() {
            return None;
        }
        let why: Vec<String> = self.engines.iter().filter_map(|e| e.down_reason()).collect();
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Why no replica takes requests now (down, restarting or loading).
    pub fn unready_reason(&self) -> String {
        let why: Vec<String> = self.engines.iter().map(|e| e.unready_reason()).collect();
        why.join("; ")
    }

    /// Every replica's state for `/health`: (up, why not).
    pub fn states(&self) -> Vec<(bool, String)> {
        self.engines.iter().map(|e| (e.healthy(), e.unready_reason())).collect()
    }

    /// The server's figures: every replica's summed.
    pub fn gauges(&self) -> Gauges {
        self.engines.iter().map(|e| e.gauges()).fold(Gauges::default(), |a, g| a + g)
    }

    /// `/metrics`: every replica's series.
    pub fn render_metrics(&self, model: &str) -> String {
        let scrapes: Vec<Scrape> =
            self.engines.iter().map(|e| Scrape { metrics: &e.metrics, gauges: e.gauges(), up: e.healthy() }).collect();
        crate::metrics::render(&scrapes, model)
    }

    /// A timeline of the first replica that is up.
    pub async fn record_trace(&self, span: Duration) -> Result<m3c_front::trace::Collected, TraceError> {
        match self.engines.iter().find(|e| e.healthy()) {
            Some(e) => e.record_trace(span).await,
            None => Err(TraceError::Down(self.down_reason().unwrap_or_else(|| "the model is loading".into()))),
        }
    }

    /// Ends every open request on every replica with `why`.
    pub fn fail_open(&self, why: &str) {
        for e in &self.engines {
            e.fail_open(why);
        }
    }

    /// Closes every first stage's input: each finishes and stops.
    pub fn close_input(&self) {
        for e in &self.engines {
            e.close_input();
        }
    }

    /// Resolves when every replica is down, with their reasons.
    pub async fn wait_all_down(&self) -> String {
        let mut why = Vec::new();
        for e in &self.engines {
            why.push(e.wait_down().await);
        }
        why.dedup();
        why.join("; ")
    }
}

/// The block hashes of a prompt's full blocks, as its first stage names
/// them (text; a block with an image's rows hashes its content there too,
/// so the routing of image prompts only knows the blocks before them and
/// what was routed).
fn prompt_chain(ids: &[i64], block: usize) -> Vec<BlockHash> {
    let mut chain = Vec::new();
    BlockHash::extend_chain(&mut chain, ids, block, |_| Vec::new());
    chain
}
