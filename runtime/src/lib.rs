//! The m3c runtime: linked into every stage executable (`OUT/stage-K`), it
//! provides `main`. MPI starts the ranks (one per stage) and carries
//! activations between them; each rank checks it belongs to this compile
//! (`startup`), maps its own weights (`weights`), keeps its sequences' KV
//! and index-key caches and runs the compiled `m3c_stage_step` (`stage`),
//! on micro-batches scheduled by `pipeline` and moved by `wire`, while
//! `liveness` tells live peers from lost ones.

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
mod batching;
mod books;
mod cpu_check;
mod device;
mod draft;
mod encoder;
mod encodes;
mod error;
mod feed;
mod follow;
mod in_flight;

use error::StageError;
mod dump;
mod liveness;
mod meta;
mod node;
mod pipeline;
mod sampler;
mod schedule;
mod serve;
mod stage;
mod startup;
mod tag;
mod trace;
mod trace_exchange;
mod weights;
mod wire;

use liveness::Peers;
use mpi::topology::{Communicator, SimpleCommunicator};

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
    let n = (cores / node::local().1).max(1);
    // SAFETY: a plain setter of the OpenMP runtime, called before any kernel runs.
    unsafe { omp_set_num_threads(n as c_int) };
    n
}

/// Memory a step frees stays with the process for the next step, instead of
/// going back to the kernel and being faulted in and zeroed again: glibc
/// otherwise unmaps buffers of a few MB (kernel scratch, step activations)
/// on every free and trims the heap's top. That cost 12 % of a 512-token
/// prefill's CPU time (three times the page faults). The price is that the
/// resident size stays at its peak, which the stage reports anyway. A user's
/// own malloc settings (`GLIBC_TUNABLES`, `MALLOC_*_`) win.
fn keep_freed_memory() {
    let own = std::env::vars_os().any(|(k, v)| {
        let k = k.to_string_lossy();
        k.starts_with("MALLOC_") || (k == "GLIBC_TUNABLES" && v.to_string_lossy().contains("glibc.malloc."))
    });
    #[cfg(target_env = "gnu")]
    if !own {
        // SAFETY: plain setters of glibc's allocator, valid at any time; a
        // refused value (it returns 0) leaves glibc's default.
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, c_int::MAX);
            // glibc's largest: bigger blocks are mapped on their own.
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        }
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = own;
}

/// This machine's name, as MPI sees it: across hosts, which stage ran where.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "?".into(), |h| h.trim().to_string())
}

fn embedded_meta() -> Result<meta::StageMeta, String> {
    // SAFETY: m3c emits both symbols: `m3c_stage_meta_len` bytes of JSON at `m3c_stage_meta`.
    let bytes = unsafe { std::slice::from_raw_parts(&m3c_stage_meta as *const u8, m3c_stage_meta_len as usize) };
    meta::StageMeta::parse(bytes)
}

#[no_mangle]
pub extern "C" fn main(_argc: c_int, _argv: *const *const c_char) -> c_int {
    std::panic::catch_unwind(run).unwrap_or(101)
}

/// The KV pool blocks this stage offers: `--kv-blocks`, else `--kv-fraction`
/// of its free memory (a GPU's after the weights), else one sequence of the
/// model's whole context.
fn pool_blocks(st: &stage::Stage, args: &m3c_contract::stage_args::StageArgs) -> Result<usize, StageError> {
    use m3c_contract::blocks::{blocks_for, MAX_BLOCKS};
    use m3c_contract::stage_args::PoolSize;
    Ok(match args.kv.size {
        PoolSize::Blocks(n) => n,
        PoolSize::Fraction(f) => ((f * st.free_memory()? as f64) as usize / st.block_bytes().max(1)).min(MAX_BLOCKS),
        PoolSize::WholeContext => blocks_for(st.meta.max_positions, st.meta.kv_block),
    })
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
    liveness::die_with_parent();
    keep_freed_memory();
    let meta = embedded_meta();
    let who = match &meta {
        Ok(m) => format!("m3c stage {}/{}", m.stage, m.stages),
        Err(_) => "m3c stage ?".to_string(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let parsed = args::parse(&argv);
    let timeout = Duration::from_secs_f64(parsed.as_ref().map_or(args::DEFAULT_TIMEOUT_S, |a| a.timeout_s));
    let init = startup::InitWatch::start(who.clone(), timeout.max(startup::MIN_INIT_DEADLINE));
    // Heartbeats come from a thread of their own, so MPI must take calls
    // from several threads.
    let Some((universe, threading)) = mpi::initialize_with_threading(mpi::Threading::Multiple) else {
        say!("{who}: error: MPI could not be initialised");
        return 1;
    };
    init.done();
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    // An encoder rank names itself by its place among the encoder ranks.
    let who = match &meta {
        Ok(m) if m.encoder => format!("m3c encoder {}/{}", rank.saturating_sub(m.stages), m.encoders),
        _ => who,
    };
    let beats = (threading >= mpi::Threading::Multiple).then(|| liveness::start_heartbeats(size, rank));
    if beats.is_none() {
        say!("{who}: MPI offers no multi-threaded calls; peers are declared lost after --timeout-s without a message, even while they compute");
    }
    let mut peers = Peers::new(size, rank, timeout);
    // A panic is a runtime bug: it ends the whole job at once (peers would
    // otherwise wait on this rank, whose heartbeats go on, for ever).
    let main = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stage_main(&world, &mut peers, &who, meta, parsed, &argv)));
    let code = match main {
        Ok(Ok(())) => 0,
        Ok(Err(())) => 1,
        Err(_) => startup::abort_job(&world, &who, "a runtime bug ended this stage (the panic above); please report it"),
    };
    let had_beats = beats.is_some();
    liveness::stop_heartbeats(beats);
    if had_beats && !startup::barrier_within(&world, timeout) {
        say!("{who}: error: a peer did not reach the end of the job within --timeout-s");
        startup::end_daemon_later();
        // SAFETY: _exit skips MPI_Finalize, which would wait for the missing
        // peer; mpirun reports the exit and ends the job.
        unsafe { libc::_exit(1) };
    }
    code
}

/// This rank's own start-up checks: MPI started one rank per stage, this
/// CPU has what the stage was compiled to use, the arguments parse, and
/// every prompt fits the vocabulary and the positions.
fn local_checks(
    meta: meta::StageMeta,
    parsed: Result<args::RunArgs, StageError>,
    size: usize,
) -> Result<(meta::StageMeta, args::RunArgs), String> {
    if size != meta.stages + meta.encoders {
        let encoders = if meta.encoders > 0 { format!(" : -np {} OUT/encoder", meta.encoders) } else { String::new() };
        return Err(format!(
            "this pipeline has {} stages{} but MPI started {size} rank(s); run one rank per stage{}: \
             mpirun -np 1 OUT/stage-0 : ... : -np 1 OUT/stage-{}{encoders} (or OUT/run.sh)",
            meta.stages,
            if meta.encoders > 0 { format!(" and {} encoder rank(s)", meta.encoders) } else { String::new() },
            if meta.encoders > 0 { ", then the encoder ranks" } else { "" },
            meta.stages - 1
        ));
    }
    cpu_check::check(&meta)?;
    let a = parsed.map_err(|e| e.to_string())?;
    for (i, p) in a.prompts.inline().iter().enumerate() {
        if let Some(bad) = p.iter().find(|&&t| t < 0 || t as usize >= meta.vocab) {
            return Err(format!("prompt {i}: token id {bad} is outside the vocabulary (0..{})", meta.vocab));
        }
        // One more position than the tokens: the cache holds the last id too.
        if p.len().checked_add(a.max_new_tokens).is_none_or(|n| n >= meta.max_positions) {
            return Err(format!(
                "prompt {i}: {} tokens + --max-new-tokens {} exceed the model's {} positions (max_position_embeddings)",
                p.len(),
                a.max_new_tokens,
                meta.max_positions
            ));
        }
    }
    Ok((meta, a))
}

/// Everything between MPI's start and end: start-up verdicts, weights,
/// device, pipeline, closing verdict. `Err(())` once the reason has been
/// printed and every rank agrees to stop.
fn stage_main(
    world: &SimpleCommunicator,
    peers: &mut Peers,
    who: &str,
    meta: Result<meta::StageMeta, String>,
    parsed: Result<args::RunArgs, StageError>,
    argv: &[String],
) -> Result<(), ()> {
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    // Local checks first; then one gather tells every rank every verdict.
    let local = meta.and_then(|meta| local_checks(meta, parsed, size));
    // An encoder rank (after the stages) reports its rank: ranks then run
    // in order whatever the split.
    let (compile_id, stage_no) = local
        .as_ref()
        .map_or((String::new(), usize::MAX), |(m, _)| (m.compile_id.clone(), if m.encoder && rank >= m.stages { rank } else { m.stage }));
    let record = startup::identity(local.is_ok(), &compile_id, stage_no, &startup::args_hash(argv));
    let all = startup::gather(world, peers, who, &record);
    match (startup::judge_identities(&all), &local) {
        (None, _) => {}
        (Some(_), Err(e)) => {
            // Failed locally: the lowest such rank explains (the others
            // usually have the same complaint).
            if all.chunks(startup::ID_BYTES).position(|r| r[0] == 0) == Some(rank) {
                say!("{who}: error: {e}");
            }
            return Err(());
        }
        (Some(why), Ok(_)) => {
            if rank == 0 && !why.is_empty() {
                say!("{who}: error: {why}");
            }
            return Err(());
        }
    }
    let Ok((meta, args)) = local else { return Err(()) };

    // Weights: each rank maps its own (and the last checks its dump
    // targets before any work); then all agree on whether to go on.
    let t0 = Instant::now();
    let holds = meta.holds.clone();
    let weights = startup::agree(world, peers, &format!("{who} ({holds})"), load_weights(&meta, &args))?;
    watch_weight_files(who, &weights);
    node::set(args.node_share);
    let threads = set_kernel_threads();
    let on_gpu = meta.target.is_gpu();
    let st = if on_gpu {
        let local_rank = i32::try_from(node::local().0).unwrap_or(0);
        stage::Stage::gpu(meta, weights, local_rank, who)
    } else {
        Ok(stage::Stage::host(meta, weights))
    };
    // Every rank learns whether every device came up.
    let mut st = startup::agree(world, peers, &format!("{who} ({holds})"), st)?;
    // The KV pool. Every stage's has the same block count (the first
    // stage's allocator hands out ids for all): the least any stage offers.
    let offered = pool_blocks(&st, &args);
    let all = startup::gather(world, peers, who, &(*offered.as_ref().unwrap_or(&0) as u64).to_le_bytes());
    let blocks = all.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize).min().unwrap_or(0);
    let pooled = offered.and_then(|_| {
        if blocks == 0 {
            return Err(StageError::Device("a stage has no memory for a single KV cache block (--kv-fraction, --kv-blocks)".into()));
        }
        st.alloc_pool(blocks)
    });
    startup::agree(world, peers, &format!("{who} ({holds})"), pooled)?;
    st.set_graphs(args.gpu.graphs);
    if args.gpu.prefill_gemm_vendor && on_gpu {
        let min_rows = std::env::var("M3C_GEMM_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(32);
        match st.device().map_or(Ok(()), |g| g.enable_gemm(min_rows)) {
            Ok(()) => say!("{who}: prefill linears with bf16 weights of {min_rows}+ rows run on cuBLAS"),
            Err(e) => say!("{who}: {e}; prefill linears stay on m3c's GEMV kernel"),
        }
    }
    let linked = connect_gpus(world, peers, who, &mut st);
    startup::agree(world, peers, who, linked)?;
    let (rss, _) = resident();
    say!(
        "{who}: {holds}: {} in {:.2} s, KV pool of {} blocks of {} positions ({:.2} MB), resident {:.1} MB, {threads} kernel thread(s){}, on host {}",
        st.placement(),
        t0.elapsed().as_secs_f64(),
        st.pool_blocks(),
        st.meta.kv_block,
        (st.pool_blocks() * st.block_bytes()) as f64 / 1e6,
        rss,
        match (st.uses_collectives(), &st.meta.target) {
            (false, _) => "",
            (true, m3c_contract::target::Target::Rocm { .. }) => ", activations over RCCL",
            (true, _) => ", activations GPU to GPU (collectives library)",
        },
        host_name()
    );
    let run = pipeline::run(world, peers, &mut st, &args);
    let closing = match run {
        Ok(c) => c,
        // Mid-run: peers may be blocked on this stage; end the whole job.
        Err(e) => startup::abort_job(world, who, &e.to_string()),
    };
    let ok = closing.is_ok();
    // The closing verdict: every rank has left its loop; all exit alike.
    startup::agree(world, peers, who, closing)?;
    let (rss, peak) = resident();
    let gpu = st
        .gpu_scratch()
        .map(|(_, p)| {
            format!(", GPU scratch peak {:.1} MB, {} decode step(s) replayed from device graphs", p as f64 / 1e6, st.graph_replays())
        })
        .unwrap_or_default();
    if ok {
        // Caches live only as long as their sequences: the peak is what
        // they needed.
        say!(
            "{who}: done; {}; caches {:.2} MB at the most, resident {rss:.1} MB, peak {peak:.1} MB{gpu}",
            st.timing(),
            st.cache_peak() as f64 / 1e6
        );
    }
    Ok(())
}

/// This stage's weights (mapped from the checkpoint, or synthetic), once the
/// last stage has checked that its dump targets can be written.
fn load_weights(meta: &meta::StageMeta, args: &args::RunArgs) -> Result<weights::StageWeights, StageError> {
    use m3c_contract::stage_args::Weights;
    let w = match &args.weights {
        Weights::Checkpoint(model) => {
            let draft = args.eagle3.as_ref().map(|e| e.model.as_path());
            weights::check_config(model, meta)?;
            if let Some(d) = draft {
                weights::check_draft_config(d, meta)?;
            }
            weights::StageWeights::open(model, draft, meta)?
        }
        Weights::Synthetic(seed) => weights::StageWeights::synthetic(meta, *seed),
    };
    if let (true, Some(file)) = (meta.last_stage, &args.dump) {
        for i in 0..args.prompt_count() {
            dump::check_target(&dump::dump_path(file, i, args.prompt_count()))?;
        }
    }
    Ok(w)
}

/// A checkpoint file truncated or rewritten under its mapping ends the job
/// with this message instead of a bus error.
fn watch_weight_files(who: &str, weights: &weights::StageWeights) {
    liveness::watch_mappings(
        who,
        weights
            .regions
            .iter()
            .map(|(start, len, file)| liveness::Mapping {
                start: *start,
                len: *len,
                message: format!("{who}: error: {} changed during the run (truncated or rewritten under its memory mapping); the checkpoint must not be modified while stages run\n", file.display()).into_bytes(),
            })
            .collect(),
    );
}

/// Sets up the collectives library (NCCL or RCCL) between the stages when every rank is a GPU stage on its
/// own device and the library loads everywhere (`M3C_TRANSPORT=host` keeps MPI).
/// Every rank reaches the same decision from the same gathered facts.
fn connect_gpus(world: &SimpleCommunicator, peers: &mut Peers, who: &str, st: &mut stage::Stage) -> Result<(), StageError> {
    let size = world.size() as usize;
    if size < 2 {
        return Ok(());
    }
    let forced_host = std::env::var("M3C_TRANSPORT").map(|v| v == "host").unwrap_or(false);
    let key = match (st.device_key(), st.device(), forced_host) {
        (Some(k), Some(gpu), false) => match gpu.links_available() {
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
    let all = startup::gather(world, peers, who, &mine);
    let keys: Vec<&[u8]> = all.chunks(64).collect();
    let distinct: std::collections::BTreeSet<&[u8]> = keys.iter().copied().collect();
    if keys.iter().any(|k| k.iter().all(|&b| b == 0)) || distinct.len() != size {
        return Ok(()); // a host stage, no collectives library, or two stages on one GPU: host-staged transfers
    }
    let mut id = [0u8; 128];
    if world.rank() == 0 {
        id = st.device().ok_or_else(|| StageError::Device("runtime bug: a link between GPUs for a host stage".into()))?.link_id()?;
    }
    startup::broadcast(world, peers, who, &mut id[..]);
    let gpu = st.device().ok_or_else(|| StageError::Device("runtime bug: a link between GPUs for a host stage".into()))?;
    let link = gpu.join_link(id, size as i32, world.rank())?;
    st.use_collectives(link);
    Ok(())
}
