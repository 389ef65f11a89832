//! Images and videos encoded off the step loop: the first stage's vision
//! entry runs on a thread of its own ([`Worker`]), so running sequences
//! keep taking steps while a request's images encode, and the request
//! joins the batch when its features are ready. Features are kept by
//! content ([`EncoderCache`], vLLM's multimodal cache): an image grid or
//! video chunk seen before is not encoded again.
//!
//! A grid's features depend only on its patch rows and grid, so neither
//! the cache nor the thread changes a bit of any result: they change only
//! when a request may start.

use m3c_contract::images::SeqImages;
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::sync::Arc;

/// A grid's content hash (its size and every patch value).
pub(crate) type GridKey = [u8; 32];

/// Encoded features by content, the least recently used given up first
/// once the bytes pass the bound.
pub(crate) struct EncoderCache {
    limit: u64,
    entries: HashMap<GridKey, (Arc<Vec<f32>>, u64)>,
    /// Last use → key, oldest first.
    order: BTreeMap<u64, GridKey>,
    clock: u64,
    bytes: u64,
    pub hits: u64,
    pub misses: u64,
}

impl EncoderCache {
    pub fn new(limit: u64) -> EncoderCache {
        EncoderCache { limit, entries: HashMap::new(), order: BTreeMap::new(), clock: 0, bytes: 0, hits: 0, misses: 0 }
    }

    /// The features of grid `key`, counted as a hit or a miss.
    pub fn get(&mut self, key: &GridKey) -> Option<Arc<Vec<f32>>> {
        self.clock += 1;
        let Some((feats, used)) = self.entries.get_mut(key) else {
            self.misses += 1;
            return None;
        };
        self.order.remove(used);
        *used = self.clock;
        self.order.insert(self.clock, *key);
        self.hits += 1;
        Some(feats.clone())
    }

    /// Keeps `feats` for `key`, giving up the oldest entries to stay within
    /// the bound (features larger than the whole bound are not kept).
    pub fn put(&mut self, key: GridKey, feats: Arc<Vec<f32>>) {
        let size = feats.len() as u64 * 4;
        if size > self.limit || self.entries.contains_key(&key) {
            return;
        }
        while self.bytes + size > self.limit {
            let Some((_, old)) = self.order.pop_first() else { break };
            if let Some((f, _)) = self.entries.remove(&old) {
                self.bytes -= f.len() as u64 * 4;
            }
        }
        self.clock += 1;
        self.order.insert(self.clock, key);
        self.entries.insert(key, (feats, self.clock));
        self.bytes += size;
    }

    /// (entries, bytes) held.
    pub fn held(&self) -> (u64, u64) {
        (self.entries.len() as u64, self.bytes)
    }
}

/// What runs the vision entry: the stage's backing gives one that may run
/// on another thread (a host stage's), or none.
pub(crate) type RunVision = Box<dyn FnMut(&SeqImages, &mut [f32]) + Send>;

/// Grids of one request to encode.
pub(crate) struct Job {
    pub seq: usize,
    pub images: SeqImages,
    /// f32 words of features per image token.
    pub words: usize,
}

/// A finished job: its features (`[tokens, words]`) and the seconds spent.
pub(crate) struct Done {
    pub seq: usize,
    pub feats: Vec<f32>,
    pub seconds: f64,
}

/// The vision entry on a thread of its own, fed jobs in order.
pub(crate) struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    rx: mpsc::Receiver<Done>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    pub fn start(mut run: RunVision) -> Worker {
        let (tx, jobs) = mpsc::channel::<Job>();
        let (done, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("m3c-encoder".into())
            .spawn(move || {
                for job in jobs {
                    let t0 = std::time::Instant::now();
                    let tokens: usize = job.images.tokens().iter().sum();
                    let mut feats = vec![0f32; tokens * job.words];
                    run(&job.images, &mut feats);
                    if done.send(Done { seq: job.seq, feats, seconds: t0.elapsed().as_secs_f64() }).is_err() {
                        break;
                    }
                }
            })
            .ok();
        Worker { tx: Some(tx), rx, thread }
    }

    /// Queues a job; gives it back when the thread is gone (it could not
    /// start), for the caller to run.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        match (&self.thread, &self.tx) {
            (Some(_), Some(tx)) => tx.send(job).map_err(|e| e.0),
            _ => Err(job),
        }
    }

    /// A finished job, if one is ready.
    pub fn try_done(&self) -> Option<Done> {
        self.rx.try_recv().ok()
    }
}

impl Drop for Worker {
    /// The queue closes and the thread finishes its job in hand: it runs
    /// the stage's compiled vision entry over the stage's weights, which
    /// must outlive it.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_what_fits_and_gives_up_the_oldest() {
        let mut c = EncoderCache::new(40);
        let f = |n: usize| Arc::new(vec![0f32; n]);
        c.put([1; 32], f(4));
        c.put([2; 32], f(4));
        assert!(c.get(&[1; 32]).is_some());
        // 16 + 16 + 16 > 40: the least recently used (2) goes.
        c.put([3; 32], f(4));
        assert!(c.get(&[2; 32]).is_none());
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        assert_eq!(c.held(), (2, 32));
        // Larger than the whole bound: not kept.
        c.put([4; 32], f(11));
        assert!(c.get(&[4; 32]).is_none());
        assert_eq!((c.hits, c.misses), (3, 2));
    }

    #[test]
    fn the_worker_runs_jobs_in_order() {
        let run: RunVision = Box::new(|im: &SeqImages, out: &mut [f32]| out.fill(im.grids[0][0] as f32));
        let w = Worker::start(run);
        for seq in 0..3 {
            let images = SeqImages { grids: vec![[seq + 1, 2, 2]], pixels: vec![0.0; 4 * (seq + 1)] };
            assert!(w.submit(Job { seq, images, words: 2 }).is_ok());
        }
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < 3 && std::time::Instant::now() < deadline {
            got.extend(w.try_done());
        }
        let seen: Vec<(usize, Vec<f32>)> = got.into_iter().map(|d| (d.seq, d.feats)).collect();
        assert_eq!(seen, vec![(0, vec![1.0; 2]), (1, vec![2.0; 4]), (2, vec![3.0; 6])]);
    }
}
