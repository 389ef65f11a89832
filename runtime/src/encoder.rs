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

use crate::tag;
use m3c_contract::images::SeqImages;
use std::sync::mpsc;

use crate::stage::RunVision;

/// Encodes are throughput work beside latency-bound steps: where they share
/// a host's cores with stages, the encoder thread gives way (nice 10).
/// The OpenMP team its kernels run on is made from this thread, and
/// inherits its priority.
fn yield_to_steps() {
    // SAFETY: setpriority on the calling thread's own id changes only that
    // thread's scheduling priority; a failure (no permission) leaves it as
    // it was, which is harmless.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
}

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
    /// Grids encoded.
    pub grids: usize,
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
                yield_to_steps();
                for job in jobs {
                    let started = std::time::Instant::now();
                    let tokens: usize = job.images.tokens().iter().sum();
                    let mut feats = vec![0f32; tokens * job.words];
                    run(&job.images, &mut feats);
                    let (seq, rows, grids, finished) = (job.seq, job.images.patches(), job.images.grids.len(), std::time::Instant::now());
                    if done.send(Done { seq, feats, started, finished, rows, grids }).is_err() {
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

/// The tower's stage when it is not the first: encode jobs arrive from the
/// first stage between this stage's own steps, run on the worker thread
/// (host) or here (GPU), and their features go back.
pub(crate) struct Remote {
    worker: Option<Worker>,
    /// Jobs run here and now, their features ready to send.
    ready: Vec<(usize, Vec<f32>)>,
}

impl Remote {
    pub fn new(st: &crate::stage::Stage) -> Remote {
        Remote { worker: st.vision_runner().map(Worker::start), ready: Vec::new() }
    }

    /// Takes every job that has arrived and sends back every result that is
    /// done. Whether anything happened, and whether the first stage said
    /// stop (encoder ranks: the job is over).
    pub fn serve(
        &mut self,
        world: &mpi::topology::SimpleCommunicator,
        peers: &mut crate::liveness::Peers,
        st: &mut crate::stage::Stage,
        outbox: &mut crate::wire::Outbox,
    ) -> Result<(bool, bool), crate::error::StageError> {
        use crate::wire::{message, try_recv, KIND_STOP, KIND_TRACE};
        let (mut any, mut stop) = (false, false);
        while let Some(m) = try_recv(world, peers, 0, tag::ENCODE) {
            any = true;
            let m = m?;
            match m.kind {
                KIND_STOP => {
                    stop = true;
                    break;
                }
                // A serving timeline window opens or closes (as the stages'
                // `KIND_TRACE`): closing, this rank's events go to the first.
                KIND_TRACE => {
                    let on = m.payload.first() == Some(&1);
                    crate::trace::set_recording(on);
                    if !on {
                        crate::trace_exchange::gather(world, peers, &crate::host_name())?;
                    }
                    continue;
                }
                _ => {}
            }
            let seq = m
                .segments
                .first()
                .map(|s| s.seq)
                .ok_or_else(|| crate::error::StageError::Peer("an encode job without its sequence".into()))?;
            let patch_row = st.meta.vision.as_ref().map_or(0, |v| v.patch_row);
            let mut files = m3c_contract::images::decode(&m.payload, patch_row)
                .map_err(|e| crate::error::StageError::Peer(format!("an encode job for sequence {seq}: {e}")))?;
            let images = files
                .remove(&0)
                .ok_or_else(|| crate::error::StageError::Peer(format!("an encode job for sequence {seq} without images")))?;
            let job = Job { seq, images, words: st.meta.x_words() };
            let job = match &self.worker {
                Some(w) => match w.submit(job) {
                    Ok(()) => continue,
                    Err(job) => job,
                },
                None => job,
            };
            let feats = st.encode_now(seq, &job.images)?;
            self.ready.push((seq, feats));
        }
        while let Some(done) = self.worker.as_ref().and_then(Worker::try_done) {
            st.count_encoded(done.grids, (done.finished - done.started).as_secs_f64());
            crate::trace::vision_beside(done.started, done.finished, done.seq, done.rows);
            self.ready.push((done.seq, done.feats));
        }
        for (seq, feats) in self.ready.drain(..) {
            any = true;
            let seg = crate::stage::Segment { seq, pos0: 0, rows: 0 };
            outbox.send(world, 0, tag::FEATURES, message(0, &[seg], &crate::wire::f32_bytes(&feats)));
        }
        Ok((any, stop))
    }
}

/// An encoder rank's whole run (a plan's `vision: {ranks: N}`): jobs from
/// the first stage until it says stop, while the first stage is alive.
pub(crate) fn serve_rank(
    world: &mpi::topology::SimpleCommunicator,
    peers: &mut crate::liveness::Peers,
    st: &mut crate::stage::Stage,
) -> Result<(), crate::error::StageError> {
    let mut remote = Remote::new(st);
    let mut outbox = crate::wire::Outbox::default();
    loop {
        let (any, stop) = remote.serve(world, peers, st, &mut outbox)?;
        if stop {
            // A job the stop overtook cannot exist: the first stage stops
            // only once every encode it asked for has come back.
            return outbox.drain(world, peers);
        }
        outbox.poll();
        peers.drain(world);
        if let Some(r) = peers.silent([0]) {
            return Err(crate::error::StageError::Peer(crate::liveness::silent_message(r, peers.timeout)));
        }
        if !any {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
}
