//! Images and videos encoded off the step loop: the first stage's vision
//! entry runs on a thread of its own ([`Worker`]), so running sequences
//! keep taking steps while a request's images encode, and the request
//! joins the batch when its features are ready. Features are kept by
//! content (`m3c_kvpool::EncoderCache`, vLLM's multimodal cache): an image
//! grid or video chunk seen before is not encoded again.
//!
//! A grid's features depend only on its patch rows and grid, so neither
//! the cache nor the thread changes a bit of any result: they change only
//! when a request may start.

use m3c_contract::images::SeqImages;
use std::sync::mpsc;

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

/// A finished job: its features (`[tokens, words]`), when it ran, and its
/// patch rows.
pub(crate) struct Done {
    pub seq: usize,
    pub feats: Vec<f32>,
    pub started: std::time::Instant,
    pub finished: std::time::Instant,
    pub rows: usize,
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
                    let started = std::time::Instant::now();
                    let tokens: usize = job.images.tokens().iter().sum();
                    let mut feats = vec![0f32; tokens * job.words];
                    run(&job.images, &mut feats);
                    let (seq, rows, finished) = (job.seq, job.images.patches(), std::time::Instant::now());
                    if done.send(Done { seq, feats, started, finished, rows }).is_err() {
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
