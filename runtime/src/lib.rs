//! The m3c runtime: linked into every stage executable (`OUT/stage-K`), it
//! provides `main`. MPI starts the ranks (one per stage) and carries
//! activations between them; each rank checks it belongs to this compile,
//! maps its own weights, keeps its sequences' KV and index-key caches and
//! runs the compiled `m3c_stage_step`.
//!
//! Pipeline: each prompt is a micro-batch. The first stage pushes every
//! prompt's prefill into the pipeline, then feeds each generated token back
//! in as soon as the last stage returns it, so stage k works on one sequence
//! while stage k+1 works on another.

/// `eprintln!` as one write, so lines of different ranks do not interleave
/// when mpirun merges them.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write;
        let line = format!("{}\n", format!($($t)*));
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

mod args;
mod cuda;
mod dump;
mod meta;
mod stage;
mod weights;

use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::collective::Root;
use mpi::traits::CommunicatorCollectives;

use std::collections::VecDeque;
use std::os::raw::{c_char, c_int};
use std::time::{Duration, Instant};

extern "C" {
    static m3c_stage_meta: u8;
    static m3c_stage_meta_len: u64;
    /// OpenMP (libomp): the generated kernels' parallel loops use this many threads.
    fn omp_set_num_threads(n: c_int);
}

/// Kernel threads for this rank: `OMP_NUM_THREADS` when set, else the cores
/// shared evenly by the ranks on this node, so stages on one machine do not
/// oversubscribe it.
fn set_kernel_threads() -> usize {
    if let Some(n) = std::env::var("OMP_NUM_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1).max(1);
    let n = (cores / local).max(1);
    // SAFETY: a plain setter of the OpenMP runtime, called before any kernel runs.
    unsafe { omp_set_num_threads(n as c_int) };
    n
}

const TAG_ACT: i32 = 7;
const TAG_IDS: i32 = 8;
const KIND_STEP: i64 = 0;
const KIND_STOP: i64 = 1;

fn embedded_meta() -> Result<meta::StageMeta, String> {
    // SAFETY: m3c emits both symbols: `m3c_stage_meta_len` bytes of JSON at `m3c_stage_meta`.
    let bytes = unsafe { std::slice::from_raw_parts(&m3c_stage_meta as *const u8, m3c_stage_meta_len as usize) };
    meta::StageMeta::parse(bytes)
}

#[no_mangle]
pub extern "C" fn main(_argc: c_int, _argv: *const *const c_char) -> c_int {
    std::panic::catch_unwind(run).unwrap_or(101)
}

/// Resident and peak resident memory of this process, from /proc.
fn resident() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

fn run() -> c_int {
    let meta = match embedded_meta() {
        Ok(m) => m,
        Err(e) => {
            say!("m3c stage: error: {e}");
            return 1;
        }
    };
    let who = format!("m3c stage {}/{}", meta.stage, meta.stages);
    let Some(universe) = mpi::initialize() else {
        say!("{who}: error: MPI could not be initialised");
        return 1;
    };
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);

    // Every check below gives every rank the same verdict, so all of them
    // report and exit together instead of leaving a peer waiting.
    if size != meta.stages {
        say!(
            "{who}: error: this pipeline has {} stages but MPI started {size} rank(s); run one rank per stage: \
             mpirun -np 1 OUT/stage-0 : ... : -np 1 OUT/stage-{}",
            meta.stages,
            meta.stages - 1
        );
        return 1;
    }
    let mut id = [0u8; 64];
    let b = meta.compile_id.as_bytes();
    id[..b.len().min(64)].copy_from_slice(&b[..b.len().min(64)]);
    let mut ids = vec![0u8; 64 * size];
    world.all_gather_into(&id[..], &mut ids[..]);
    let mut stage_of = vec![0u64; size];
    world.all_gather_into(&(meta.stage as u64), &mut stage_of[..]);
    let foreign: Vec<usize> = (0..size).filter(|&r| ids[r * 64..(r + 1) * 64] != id[..]).collect();
    if !foreign.is_empty() {
        let list: Vec<String> = (0..size)
            .map(|r| format!("rank {r}: {}", String::from_utf8_lossy(&ids[r * 64..(r + 1) * 64]).trim_end_matches('\0').chars().take(12).collect::<String>()))
            .collect();
        say!(
            "{who}: error: the ranks come from different compiles (compile ids {}); start the stage executables of one OUT folder",
            list.join(", ")
        );
        return 1;
    }
    if stage_of.iter().enumerate().any(|(r, &s)| r as u64 != s) {
        say!("{who}: error: stages started out of order (rank r must run stage-r; ranks run stages {stage_of:?})");
        return 1;
    }
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match args::parse(&argv).and_then(|a| {
        for (i, p) in a.prompts.iter().enumerate() {
            if let Some(bad) = p.iter().find(|&&t| t < 0 || t as usize >= meta.vocab) {
                return Err(format!("prompt {i}: token id {bad} is outside the vocabulary (0..{})", meta.vocab));
            }
            if p.len() + a.max_new_tokens > meta.max_positions {
                return Err(format!(
                    "prompt {i}: {} tokens + --max-new-tokens {} exceed the model's {} positions (max_position_embeddings)",
                    p.len(),
                    a.max_new_tokens,
                    meta.max_positions
                ));
            }
        }
        Ok(a)
    }) {
        Ok(a) => a,
        Err(e) => {
            if rank == 0 {
                say!("m3c: error: {e}");
            }
            return 1;
        }
    };

    // Weights: each rank maps its own; then all agree on whether to go on.
    let t0 = Instant::now();
    let loaded = match (&args.model, args.synthetic_seed) {
        (Some(model), _) => weights::check_config(model, &meta).and_then(|_| weights::StageWeights::open(model, &meta)),
        (None, Some(seed)) => Ok(weights::StageWeights::synthetic(&meta, seed)),
        (None, None) => Err("no weights".into()),
    };
    let ok = loaded.is_ok() as u8;
    let mut oks = vec![0u8; size];
    world.all_gather_into(&ok, &mut oks[..]);
    let weights = match loaded {
        Err(e) => {
            say!("{who} ({}): error: {e}", meta.holds);
            return 1;
        }
        Ok(_) if oks.contains(&0) => return 1,
        Ok(w) => w,
    };
    let threads = set_kernel_threads();
    let holds = meta.holds.clone();
    let meta_is_cuda = meta.target.starts_with("cuda");
    let st = if meta_is_cuda {
        let local_rank = std::env::var("OMPI_COMM_WORLD_LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        stage::Stage::gpu(meta, weights, local_rank, &who)
    } else {
        Ok(stage::Stage::host(meta, weights))
    };
    // Every rank learns whether every device came up.
    let ok = st.is_ok() as u8;
    let mut oks = vec![0u8; size];
    world.all_gather_into(&ok, &mut oks[..]);
    let mut st = match st {
        Err(e) => {
            say!("{who} ({holds}): error: {e}");
            return 1;
        }
        Ok(_) if oks.contains(&0) => return 1,
        Ok(s) => s,
    };
    st.set_cuda_graphs(args.cuda_graphs);
    if args.prefill_gemm_cublas && meta_is_cuda {
        let min_rows = std::env::var("M3C_GEMM_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(32);
        match cuda::cublas::enable(min_rows) {
            Ok(()) => say!("{who}: prefill linears with bf16 weights of {min_rows}+ rows run on cuBLAS"),
            Err(e) => say!("{who}: {e}; prefill linears stay on m3c's GEMV kernel"),
        }
    }
    if let Err(e) = connect_gpus(&world, &mut st) {
        say!("{who}: error: {e}");
        return 1;
    }
    let (rss, _) = resident();
    say!(
        "{who}: {holds}: {} in {:.2} s, resident {:.1} MB, {threads} kernel thread(s){}",
        st.placement(),
        t0.elapsed().as_secs_f64(),
        rss,
        if st.uses_nccl() { ", activations over NCCL" } else { "" }
    );
    let timeout = Duration::from_secs_f64(args.timeout_s);
    match pipeline(&world, &mut st, &args, timeout) {
        Ok(()) => {
            let (rss, peak) = resident();
            let gpu = st
                .gpu_scratch()
                .map(|(_, p)| format!(", GPU scratch peak {:.1} MB, {} decode step(s) replayed from CUDA graphs", p as f64 / 1e6, st.graph_replays()))
                .unwrap_or_default();
            say!(
                "{who}: done; {}; caches {:.2} MB, resident {rss:.1} MB, peak {peak:.1} MB{gpu}",
                st.timing(),
                st.cache_bytes() as f64 / 1e6
            );
            0
        }
        Err(e) => {
            say!("{who}: error: {e}");
            world.abort(1)
        }
    }
}

/// A message between stages: a kind, the micro-batch's segments, and a payload
/// (activations [S, hidden] as f32 words, two bf16 to a word under `--activations bf16`; or the last stage's ids, one per segment).
/// Sets up NCCL between the stages when every rank is a GPU stage on its
/// own device and NCCL loads everywhere (`M3C_TRANSPORT=host` keeps MPI).
/// Every rank reaches the same decision from the same gathered facts.
fn connect_gpus(world: &SimpleCommunicator, st: &mut stage::Stage) -> Result<(), String> {
    let size = world.size() as usize;
    if size < 2 {
        return Ok(());
    }
    let forced_host = std::env::var("M3C_TRANSPORT").map(|v| v == "host").unwrap_or(false);
    let key = match (st.device_key(), forced_host) {
        (Some(k), false) => match cuda::nccl::availability() {
            Ok(()) => k,
            Err(why) => {
                // Not silent: host-staged transfers cost every step.
                say!("m3c stage {}: {why}; activations go through host memory and MPI", st.meta.stage);
                String::new()
            }
        },
        _ => String::new(),
    };
    let mut mine = [0u8; 64];
    let kb = key.as_bytes();
    mine[..kb.len().min(64)].copy_from_slice(&kb[..kb.len().min(64)]);
    let mut all = vec![0u8; 64 * size];
    world.all_gather_into(&mine[..], &mut all[..]);
    let keys: Vec<&[u8]> = all.chunks(64).collect();
    let distinct: std::collections::BTreeSet<&[u8]> = keys.iter().copied().collect();
    if keys.iter().any(|k| k.iter().all(|&b| b == 0)) || distinct.len() != size {
        return Ok(()); // a host stage, no NCCL, or two stages on one GPU: host-staged transfers
    }
    let mut id = [0u8; 128];
    if world.rank() == 0 {
        id = cuda::nccl::unique_id()?;
    }
    world.process_at_rank(0).broadcast_into(&mut id[..]);
    let link = cuda::nccl::Link::join(id, size as i32, world.rank())?;
    st.use_nccl(link);
    Ok(())
}

fn message(kind: i64, segments: &[stage::Segment], payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(16 + 24 * segments.len() + payload.len());
    m.extend(kind.to_le_bytes());
    m.extend((segments.len() as i64).to_le_bytes());
    for s in segments {
        for v in [s.seq as i64, s.pos0 as i64, s.rows as i64] {
            m.extend(v.to_le_bytes());
        }
    }
    m.extend_from_slice(payload);
    m
}

struct Msg {
    kind: i64,
    segments: Vec<stage::Segment>,
    payload: Vec<u8>,
}

fn parse_msg(m: Vec<u8>) -> Result<Msg, String> {
    let h = |i: usize| -> Result<i64, String> {
        m.get(i * 8..i * 8 + 8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).ok_or_else(|| format!("malformed message of {} bytes", m.len()))
    };
    let kind = h(0)?;
    let n = h(1)? as usize;
    let mut segments = Vec::with_capacity(n);
    for i in 0..n {
        segments.push(stage::Segment { seq: h(2 + 3 * i)? as usize, pos0: h(3 + 3 * i)? as usize, rows: h(4 + 3 * i)? as usize });
    }
    let start = (2 + 3 * n) * 8;
    Ok(Msg { kind, segments, payload: m.get(start..).unwrap_or_default().to_vec() })
}

/// Receives the next message with `tag` from rank `from`, or fails after `timeout`.
fn recv(world: &SimpleCommunicator, from: usize, tag: i32, timeout: Duration) -> Result<Msg, String> {
    let p = world.process_at_rank(from as i32);
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if let Some(m) = p.immediate_matched_probe_with_tag(tag) {
            let (v, _) = m.matched_receive_vec::<u8>();
            return parse_msg(v);
        }
        if start.elapsed() > timeout {
            return Err(format!("nothing from stage {from} for {:.0} s (--timeout-s); is that stage alive?", timeout.as_secs_f64()));
        }
        spins += 1;
        if spins < 2000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Sends in flight. A stage hands a message to MPI and goes on computing;
/// the buffer lives until MPI reports the send complete (a blocking send
/// would wait for the next stage to finish its own step first).
/// A send in flight and the leaked buffer it reads.
type Pending = (mpi::request::Request<'static, [u8], mpi::request::StaticScope>, *mut [u8]);

#[derive(Default)]
struct Outbox {
    pending: Vec<Pending>,
}

impl Outbox {
    fn send(&mut self, world: &SimpleCommunicator, to: usize, tag: i32, data: Vec<u8>) {
        self.poll();
        let buf: &'static mut [u8] = Box::leak(data.into_boxed_slice());
        let ptr: *mut [u8] = buf;
        // SAFETY: the leaked buffer stays alive until the request completes
        // (`poll`/`drain` free it only then) and is never written meanwhile.
        let req = world.process_at_rank(to as i32).immediate_send_with_tag(mpi::request::StaticScope, unsafe { &*ptr }, tag);
        self.pending.push((req, ptr));
    }

    /// Frees the buffers of completed sends.
    fn poll(&mut self) {
        let mut still = Vec::with_capacity(self.pending.len());
        for (req, ptr) in self.pending.drain(..) {
            match req.test() {
                // SAFETY: the send is complete; the buffer came from Box::leak.
                Ok(_) => drop(unsafe { Box::from_raw(ptr) }),
                Err(req) => still.push((req, ptr)),
            }
        }
        self.pending = still;
    }

    /// Waits for every send (before the stage finishes).
    /// (On an error path the job is aborted instead; see `Drop`.)
    fn drain(&mut self) {
        for (req, ptr) in self.pending.drain(..) {
            req.wait();
            // SAFETY: as in `poll`.
            drop(unsafe { Box::from_raw(ptr) });
        }
    }
}

impl Drop for Outbox {
    /// Only reached with sends pending when a step failed and the job is about
    /// to be aborted: forget them rather than panic in rsmpi's request drop.
    fn drop(&mut self) {
        for (req, _) in self.pending.drain(..) {
            std::mem::forget(req);
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The last stage's record of one sequence's step; returns the greedy id of
/// its last row.
fn record(records: &mut [dump::SeqRecord], s: &stage::Segment, logits: &[f32], ids: &[i64], row0: usize, vocab: usize, max_new: usize) -> i64 {
    let r = &mut records[s.seq];
    let rows = &logits[row0 * vocab..(row0 + s.rows) * vocab];
    let plen = r.prompt.len();
    if s.pos0 < plen {
        // A prefill chunk (chunks of a sequence arrive in order).
        r.prefill_logits.extend_from_slice(rows);
    } else {
        r.decode_logits.extend_from_slice(&rows[(s.rows - 1) * vocab..]);
    }
    let id = ids[row0 + s.rows - 1];
    // Only the prompt's last row and decode rows give tokens.
    if s.pos0 + s.rows >= plen && r.generated.len() < max_new {
        r.generated.push(id);
    }
    id
}

/// The last stage's part of a step: records, and one id per segment.
fn finish(records: &mut [dump::SeqRecord], segs: &[stage::Segment], out: &stage::StepOut, vocab: usize, max_new: usize) -> Vec<i64> {
    let mut row0 = 0;
    let mut ids = Vec::with_capacity(segs.len());
    for s in segs {
        ids.push(record(records, s, &out.logits, &out.ids, row0, vocab, max_new));
        row0 += s.rows;
    }
    ids
}

fn pipeline(world: &SimpleCommunicator, st: &mut stage::Stage, args: &args::RunArgs, timeout: Duration) -> Result<(), String> {
    use stage::Segment;
    let (first, last) = (st.meta.first_stage, st.meta.last_stage);
    let (rank, size) = (st.meta.stage, st.meta.stages);
    // Activations travel as f32 words: `hidden` of them per row, or half as many for bf16.
    let (x_words, vocab) = (st.meta.x_words(), st.meta.vocab);
    let n_new = args.max_new_tokens;
    for (s, p) in args.prompts.iter().enumerate() {
        st.start_seq(s, p.len() + n_new + 1)?;
    }
    let mut records: Vec<dump::SeqRecord> = args
        .prompts
        .iter()
        .map(|p| dump::SeqRecord { prompt: p.clone(), prefill_logits: Vec::new(), generated: Vec::new(), decode_logits: Vec::new() })
        .collect();
    // Sequences per micro-batch: enough micro-batches to keep every stage busy
    // (one per stage), as few as that allows (weights are read once per step).
    let per_batch = args.micro_batch.unwrap_or_else(|| args.prompts.len().div_ceil(size)).max(1);
    let mut outbox = Outbox::default();
    // Fault injection for the tests: this stage stops answering, as a hung
    // or lost peer would, so the others must time out rather than hang.
    if std::env::var("M3C_TEST_STALL_STAGE").ok().and_then(|v| v.parse::<usize>().ok()) == Some(rank) {
        std::thread::sleep(Duration::from_secs(3600));
    }

    if first {
        // Ready work: (seq, pos0, token ids). Every prompt's prefill comes first.
        // Prompts longer than --prefill-chunk go in chunks, so a long prefill
        // moves through the stages piece by piece instead of holding each
        // stage in turn.
        let chunk = args.prefill_chunk.unwrap_or(usize::MAX).max(1);
        let mut queue: VecDeque<(usize, usize, Vec<i64>)> = args
            .prompts
            .iter()
            .enumerate()
            .flat_map(|(s, p)| p.chunks(chunk).enumerate().map(move |(k, c)| (s, k * chunk, c.to_vec())))
            .collect();
        let mut generated: Vec<Vec<i64>> = vec![Vec::new(); args.prompts.len()];
        let mut open = args.prompts.len();
        let start = Instant::now();
        let mut prefill_done = vec![None; args.prompts.len()];
        let mut on_id = |seq: usize, pos0: usize, rows: usize, id: i64, queue: &mut VecDeque<(usize, usize, Vec<i64>)>, open: &mut usize| {
            let plen = args.prompts[seq].len();
            if pos0 + rows < plen {
                return; // a prefill chunk before the prompt's last: no token yet
            }
            let pass = if pos0 < plen { 0 } else { pos0 + 1 - plen };
            if pass == 0 {
                prefill_done[seq] = Some(start.elapsed());
            }
            if pass < n_new {
                generated[seq].push(id);
                queue.push_back((seq, plen + pass, vec![id]));
            } else {
                *open -= 1;
            }
        };
        while open > 0 {
            if !queue.is_empty() {
                let take = per_batch.min(queue.len());
                let items: Vec<(usize, usize, Vec<i64>)> = queue.drain(..take).collect();
                let segs: Vec<Segment> = items.iter().map(|(s, p, ids)| Segment { seq: *s, pos0: *p, rows: ids.len() }).collect();
                let ids: Vec<i64> = items.iter().flat_map(|(_, _, ids)| ids.iter().copied()).collect();
                let mut x = vec![0f32; ids.len() * x_words];
                if !last && st.uses_nccl() {
                    // The step's NCCL send waits for the receiver, who needs the header first.
                    outbox.send(world, 1, TAG_ACT, message(KIND_STEP, &segs, &[]));
                }
                let out = st.step(&segs, &ids, &mut x)?;
                if last {
                    let got = finish(&mut records, &segs, &out, vocab, n_new);
                    for (s, id) in segs.iter().zip(got) {
                        on_id(s.seq, s.pos0, s.rows, id, &mut queue, &mut open);
                    }
                } else if !st.uses_nccl() {
                    outbox.send(world, 1, TAG_ACT, message(KIND_STEP, &segs, &f32_bytes(&x)));
                }
            } else {
                outbox.poll();
                let m = recv(world, size - 1, TAG_IDS, timeout)?;
                for (i, s) in m.segments.iter().enumerate() {
                    let id = m.payload.get(i * 8..i * 8 + 8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).ok_or("malformed id message")?;
                    on_id(s.seq, s.pos0, s.rows, id, &mut queue, &mut open);
                }
            }
        }
        let total = start.elapsed();
        if !last {
            outbox.send(world, 1, TAG_ACT, message(KIND_STOP, &[], &[]));
        }
        outbox.drain();
        for (s, g) in generated.iter().enumerate() {
            use std::io::Write;
            let ids: Vec<String> = g.iter().map(|i| i.to_string()).collect();
            let line = format!("prompt {s}: {}\n", ids.join(","));
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(line.as_bytes()).and_then(|_| out.flush());
        }
        let prefill_end = prefill_done.iter().flatten().max().copied().unwrap_or_default();
        let prompt_tokens: usize = args.prompts.iter().map(|p| p.len()).sum();
        let decode_steps = args.prompts.len() * n_new;
        let dt = (total - prefill_end).as_secs_f64();
        say!(
            "m3c timing: prefill {prompt_tokens} tokens in {:.1} ms ({:.1} tok/s); decode {decode_steps} steps in {:.1} ms ({:.1} tok/s); up to {per_batch} sequence(s) per micro-batch",
            prefill_end.as_secs_f64() * 1e3,
            prompt_tokens as f64 / prefill_end.as_secs_f64().max(1e-9),
            dt * 1e3,
            decode_steps as f64 / dt.max(1e-9)
        );
    } else {
        loop {
            outbox.poll();
            let m = recv(world, rank - 1, TAG_ACT, timeout)?;
            if m.kind == KIND_STOP {
                if !last {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_STOP, &[], &[]));
                }
                outbox.drain();
                break;
            }
            let tokens: usize = m.segments.iter().map(|s| s.rows).sum();
            let mut x = if st.uses_nccl() { vec![0f32; tokens * x_words] } else { bytes_f32(&m.payload) };
            if !last && st.uses_nccl() {
                outbox.send(world, rank + 1, TAG_ACT, message(KIND_STEP, &m.segments, &[]));
            }
            let out = st.step(&m.segments, &[], &mut x)?;
            if last {
                let got = finish(&mut records, &m.segments, &out, vocab, n_new);
                let payload: Vec<u8> = got.iter().flat_map(|i| i.to_le_bytes()).collect();
                outbox.send(world, 0, TAG_IDS, message(KIND_STEP, &m.segments, &payload));
            } else if !st.uses_nccl() {
                outbox.send(world, rank + 1, TAG_ACT, message(KIND_STEP, &m.segments, &f32_bytes(&x)));
            }
        }
    }
    if last {
        if let Some(file) = &args.dump {
            for (i, r) in records.iter().enumerate() {
                dump::write(&dump::dump_path(file, i, records.len()), r, vocab)?;
            }
        }
        if let Some(golden) = &args.expect {
            // The golden file describes one prompt: the first.
            say!("{}", dump::check(golden, &records[0], vocab, 1e-3)?);
        }
    }
    Ok(())
}
