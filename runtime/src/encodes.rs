//! The first stage's images and videos: each request's grids are taken
//! from the encoder cache where it holds them, and the others encoded,
//! beside the loop where the stage can (a worker thread, the tower's
//! stage, or an encoder rank of its own), else here and now. A request
//! whose encodes are in flight waits in the engine (`Phase::Encoding`)
//! and joins when they are done.

use crate::encoder::{Job, Worker};
use crate::error::StageError;
use crate::feed::Feed;
use crate::liveness::Peers;
use crate::stage::{Segment, Stage};
use crate::tag;
use crate::wire::{self, bytes_f32, message, Outbox};
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::{Event, SeqRequest};
use m3c_engine::kv::ImageRows;
use m3c_kvpool::EncoderCache;
use mpi::topology::SimpleCommunicator;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

/// A request and its grids' features: all in hand once it may join.
pub(crate) struct Pending {
    pub a: SeqRequest,
    pub image_rows: Vec<ImageRows>,
    placeholders: Vec<usize>,
    /// Each grid's features: from the cache, or `None` for those encoding.
    feats: Vec<Option<Arc<Vec<f32>>>>,
    /// Tokens of each grid.
    tokens: Vec<usize>,
    /// When its encode was asked for.
    asked: Instant,
    /// The rank encoding it, when another does.
    rank: Option<usize>,
}

impl Pending {
    /// The stage keeps the request's features (every one is in hand).
    pub fn hand_over(self, st: &mut Stage) -> (SeqRequest, Vec<ImageRows>) {
        let feats: Vec<f32> = self.feats.iter().flat_map(|f| f.as_deref().map_or(&[][..], Vec::as_slice)).copied().collect();
        st.set_images(self.a.seq, self.placeholders, feats);
        (self.a, self.image_rows)
    }
}

pub(crate) struct Encodes {
    /// Encoded features by content.
    cache: EncoderCache,
    /// The vision entry on a thread of its own (host stages, unless
    /// `--encodes inline`).
    worker: Option<Worker>,
    /// Requests waiting for their encodes, by sequence.
    pending: HashMap<usize, Pending>,
    /// What was last reported (to report changes only).
    last: (u64, u64, u64, u64, usize),
    /// Grids encoded for this stage, and the seconds from asking to having
    /// the features.
    encoded: (u64, f64),
}

impl Encodes {
    pub fn new(st: &Stage, opts: &m3c_contract::stage_args::EncoderOptions) -> Encodes {
        Encodes {
            cache: EncoderCache::new(opts.cache_bytes),
            worker: if opts.inline { None } else { st.vision_runner().map(Worker::start) },
            pending: HashMap::new(),
            last: (0, 0, 0, 0, 0),
            encoded: (0, 0.0),
        }
    }

    /// A checked request's grids: `Ok(Some)` once every feature is in hand
    /// (from the cache, or encoded now), `Ok(None)` while they encode
    /// beside the loop ([`Encodes::finished`]), `Err` when they cannot be.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        world: &SimpleCommunicator,
        outbox: &mut Outbox,
        st: &mut Stage,
        a: SeqRequest,
        images: SeqImages,
        image_rows: Vec<ImageRows>,
        placeholders: Vec<usize>,
    ) -> Result<Option<Pending>, String> {
        let feats: Vec<Option<Arc<Vec<f32>>>> = image_rows.iter().map(|(key, _)| self.cache.get(key)).collect();
        let tokens = images.tokens();
        let missing = missing_grids(&images, &feats);
        let seq = a.seq;
        let mut p = Pending { a, image_rows, placeholders, feats, tokens, asked: Instant::now(), rank: None };
        if missing.grids.is_empty() {
            return Ok(Some(p));
        }
        let words = st.meta.x_words();
        // The tower's stage, or the least busy encoder rank, encodes; the
        // features come back (`finished`).
        let load = |r: usize| self.pending.values().filter(|p| p.rank == Some(r)).count();
        if let Some(k) = st.encoder_ranks().into_iter().min_by_key(|&r| (load(r), r)) {
            let file = m3c_contract::images::encode(&std::collections::BTreeMap::from([(0usize, missing)]));
            outbox.send(world, k, tag::ENCODE, message(0, &[Segment { seq, pos0: 0, rows: 0 }], &file));
            p.rank = Some(k);
            self.pending.insert(seq, p);
            return Ok(None);
        }
        let missing = match &self.worker {
            Some(w) => match w.submit(Job { seq, images: missing, words }) {
                Ok(()) => {
                    self.pending.insert(seq, p);
                    return Ok(None);
                }
                Err(job) => job.images,
            },
            None => missing,
        };
        let f = st.encode_now(seq, &missing).map_err(|e| e.to_string())?;
        self.fill(&mut p, f, words);
        Ok(Some(p))
    }

    /// Puts freshly encoded features (the missing grids', in order) into a
    /// pending request and the cache.
    fn fill(&mut self, p: &mut Pending, feats: Vec<f32>, words: usize) {
        self.encoded.0 += p.feats.iter().filter(|f| f.is_none()).count() as u64;
        self.encoded.1 += p.asked.elapsed().as_secs_f64();
        let mut at = 0;
        for (i, slot) in p.feats.iter_mut().enumerate() {
            if slot.is_none() {
                let n = p.tokens[i] * words;
                let f = Arc::new(feats[at..at + n].to_vec());
                at += n;
                self.cache.put(p.image_rows[i].0, f.clone());
                *slot = Some(f);
            }
        }
    }

    /// The requests whose encodes finished beside the loop, features in hand.
    pub fn finished(&mut self, world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage) -> Result<Vec<Pending>, StageError> {
        let mut done = Vec::new();
        while let Some(d) = self.worker.as_ref().and_then(Worker::try_done) {
            st.count_encoded(d.grids, (d.finished - d.started).as_secs_f64());
            crate::trace::vision_beside(d.started, d.finished, d.seq, d.rows);
            done.push((d.seq, d.feats));
        }
        let busy: BTreeSet<usize> = self.pending.values().filter_map(|p| p.rank).collect();
        for k in busy {
            while let Some(m) = wire::try_recv(world, peers, k, tag::FEATURES) {
                let m = m?;
                let seq = m
                    .segments
                    .first()
                    .map(|s| s.seq)
                    .ok_or_else(|| StageError::Peer(format!("features from stage {k} without their sequence")))?;
                done.push((seq, bytes_f32(&m.payload)));
            }
        }
        let mut out = Vec::new();
        for (seq, feats) in done {
            let Some(mut p) = self.pending.remove(&seq) else { continue };
            let want: usize = p.feats.iter().zip(&p.tokens).filter(|(f, _)| f.is_none()).map(|(_, t)| t * st.meta.x_words()).sum();
            if feats.len() != want {
                return Err(StageError::Peer(format!(
                    "sequence {seq}: {} feature words came back for its images; expected {want}",
                    feats.len()
                )));
            }
            self.fill(&mut p, feats, st.meta.x_words());
            out.push(p);
        }
        Ok(out)
    }

    /// The encoder's figures for the front, when they changed.
    pub fn report(&mut self, feed: &mut impl Feed) {
        let (entries, bytes) = self.cache.held();
        let now = (self.cache.hits, self.cache.misses, entries, bytes, self.pending.len());
        if now != self.last && feed.wants_stats() {
            self.last = now;
            let (encoded, seconds) = self.encoded;
            feed.event(Event::Encoder {
                hits: now.0,
                misses: now.1,
                entries,
                bytes,
                in_flight: now.4 as u64,
                encoded,
                encode_us: (seconds * 1e6) as u64,
            });
        }
    }
}

/// The grids of `im` whose features are not in hand (`feats[i]` is `None`).
fn missing_grids(im: &SeqImages, feats: &[Option<Arc<Vec<f32>>>]) -> SeqImages {
    let row = im.pixels.len() / im.patches().max(1);
    let mut out = SeqImages { grids: Vec::new(), pixels: Vec::new() };
    let mut at = 0;
    for (g, f) in im.grids.iter().zip(feats) {
        let rows = g[0] * g[1] * g[2];
        if f.is_none() {
            out.grids.push(*g);
            out.pixels.extend_from_slice(&im.pixels[at * row..(at + rows) * row]);
        }
        at += rows;
    }
    out
}

/// A prompt with image placeholders needs its images, as in the reference.
pub(crate) fn placeholders_without_images(st: &Stage, prompt: &[i64]) -> Result<(), String> {
    match &st.meta.vision {
        Some(v) => match prompt.iter().filter(|&&id| v.is_placeholder(id)).count() {
            0 => Ok(()),
            n => Err(format!(
                "the prompt has {n} image or video placeholder(s) (ids {} and {}) but no image or video",
                v.image_token, v.video_token
            )),
        },
        None => Ok(()),
    }
}

/// Each image's content hash and the prompt positions of its placeholder
/// rows (the images' tokens, in order), for the prefix-cache keys.
pub(crate) fn image_rows(st: &Stage, prompt: &[i64], im: &SeqImages) -> Vec<ImageRows> {
    use sha2::{Digest, Sha256};
    let Some(v) = &st.meta.vision else { return Vec::new() };
    let mut rows = prompt.iter().enumerate().filter(|(_, &id)| v.is_placeholder(id)).map(|(p, _)| p);
    let row = im.pixels.len() / im.patches().max(1);
    let mut out = Vec::new();
    let mut at = 0;
    for (i, n) in im.tokens().into_iter().enumerate() {
        let grid = &im.grids[i];
        let patches: usize = grid.iter().product();
        let mut h = Sha256::new();
        for d in grid {
            h.update((*d as u64).to_le_bytes());
        }
        for x in im.pixels.get(at * row..(at + patches) * row).unwrap_or_default() {
            h.update(x.to_bits().to_le_bytes());
        }
        at += patches;
        out.push((h.finalize().into(), rows.by_ref().take(n).collect()));
    }
    out
}
