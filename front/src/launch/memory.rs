//! A job's memory against the machine's, before mpirun starts: what each
//! stage on this machine will hold (its weights and its KV pool) beside
//! what the host or its GPU has. Host stages map their weights (shared page
//! cache) and touch pool pages only as blocks fill, so too large a pool is
//! a warning: the job starts, and a full pool would not fit. A GPU stage
//! allocates its weights and its pool at start, so one that no GPU here
//! could hold is refused here, in one line, rather than by a stage after
//! mpirun's start-up; one that would not fit the GPU it picks by default is
//! a warning (a plan's `device` or `CUDA_VISIBLE_DEVICES` may place it
//! elsewhere, which nvidia-smi does not know).

use std::time::{Duration, Instant};

/// What one stage on this machine will hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageMemory {
    pub stage: usize,
    /// Bytes of the stage's tensors in the checkpoint.
    pub weights: u64,
    /// Bytes of its KV pool; `None` when the stage sizes it from its free
    /// memory (`--kv-fraction`, `--gpu-memory-utilization`).
    pub pool: Option<u64>,
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

/// The warning for host stages whose pools together exceed `available`.
pub fn host_warning(stages: &[StageMemory], available: u64) -> Option<String> {
    let pools: u64 = stages.iter().filter_map(|s| s.pool).sum();
    (pools > available).then(|| {
        format!(
            "m3c: warning: the {} stages' KV pools take {:.1} GB in all, more than this machine's {:.1} GB available; \
             they fill as requests run, and a full pool would not fit: give --kv-budget GB (per stage), --kv-blocks N or --kv-fraction F",
            stages.len(),
            gb(pools),
            gb(available)
        )
    })
}

/// The error for the first GPU stage whose weights and pool exceed every
/// GPU's free memory (`free`): no placement could hold it.
pub fn gpu_error(stages: &[StageMemory], free: &[u64]) -> Option<String> {
    let most = *free.iter().max()?;
    stages.iter().find(|s| s.weights + s.pool.unwrap_or(0) > most).map(|s| {
        let pool = s.pool.map_or("its weights".to_string(), |p| format!("its weights ({:.1} GB) and KV pool ({:.1} GB)", gb(s.weights), gb(p)));
        format!(
            "stage {}: {pool} need {:.1} GB, more than any GPU here has free (at most {:.1} GB); give a smaller --kv-budget (or --kv-fraction), \
             or split the model into more stages (--pp)",
            s.stage,
            gb(s.weights + s.pool.unwrap_or(0)),
            gb(most)
        )
    })
}

/// The warning for the first GPU stage whose weights and pool exceed its
/// GPU's free memory when the stages take GPUs as they do by default
/// (stage k on GPU k mod the count, by local rank).
pub fn gpu_warning(stages: &[StageMemory], free: &[u64]) -> Option<String> {
    if free.is_empty() {
        return None;
    }
    // Stages that share a GPU (more stages than GPUs) share its memory.
    let mut used = vec![0u64; free.len()];
    for s in stages {
        let g = s.stage % free.len();
        used[g] += s.weights + s.pool.unwrap_or(0);
        if used[g] > free[g] {
            let pool = s
                .pool
                .map_or("its weights".to_string(), |p| format!("its weights ({:.1} GB) and KV pool ({:.1} GB)", gb(s.weights), gb(p)));
            return Some(format!(
                "m3c: warning: stage {}: {pool} need {:.1} GB on GPU {g}, which has {:.1} GB free{}, if it runs there (its default); \
                 give a smaller --kv-budget (or --kv-fraction), or split the model into more stages (--pp)",
                s.stage,
                gb(s.weights + s.pool.unwrap_or(0)),
                gb(free[g]),
                if used[g] > s.weights + s.pool.unwrap_or(0) { " for the stages it holds" } else { "" }
            ));
        }
    }
    None
}

/// This machine's `MemAvailable`, in bytes.
pub fn host_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.split_whitespace().next()?.parse::<u64>().ok()?;
    Some(kb * 1024)
}

/// Each NVIDIA GPU's free memory in bytes, from `nvidia-smi` (given 5 s);
/// `None` where there is no nvidia-smi or it does not answer.
pub fn nvidia_free() -> Option<Vec<u64>> {
    let mut child = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.free", "--format=csv,noheader,nounits"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while child.try_wait().ok()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut text).ok()?;
    parse_free_mib(&text)
}

/// nvidia-smi's `memory.free` lines (MiB, one per GPU) in bytes.
pub fn parse_free_mib(text: &str) -> Option<Vec<u64>> {
    let free: Option<Vec<u64>> =
        text.lines().filter(|l| !l.trim().is_empty()).map(|l| l.trim().parse::<u64>().ok().map(|m| m << 20)).collect();
    free.filter(|f| !f.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    #[test]
    fn host_pools_past_the_available_memory_are_a_warning() {
        let four: Vec<StageMemory> = (0..4).map(|stage| StageMemory { stage, weights: 50 * GB, pool: Some(8 * GB) }).collect();
        let w = host_warning(&four, 23 * GB).expect("32 GB of pools on 23 GB");
        assert!(w.contains("the 4 stages' KV pools take 32.0 GB in all") && w.contains("23.0 GB available"), "{w}");
        assert_eq!(host_warning(&four, 40 * GB), None, "mapped weights are not counted, the pools fit");
    }

    #[test]
    fn a_gpu_stage_that_cannot_fit_its_gpu_is_named() {
        let stages = [
            StageMemory { stage: 0, weights: 100 * GB, pool: Some(20 * GB) },
            StageMemory { stage: 1, weights: 130 * GB, pool: Some(20 * GB) },
        ];
        let free = [140 * GB, 140 * GB];
        let e = gpu_error(&stages, &free).expect("stage 1 needs 150 GB; no GPU has more than 140");
        assert!(
            e.starts_with(
                "stage 1: its weights (130.0 GB) and KV pool (20.0 GB) need 150.0 GB, more than any GPU here has free (at most 140.0 GB);"
            ),
            "{e}"
        );
        assert_eq!(gpu_error(&stages[..1], &free), None);
        // A GPU with room elsewhere: not certain, a warning for the default placement.
        let free = [140 * GB, 140 * GB, 200 * GB];
        assert_eq!(gpu_error(&stages, &free), None);
        let w = gpu_warning(&stages, &free).expect("stage 1 on GPU 1 by default");
        assert!(w.contains("stage 1:") && w.contains("on GPU 1, which has 140.0 GB free"), "{w}");
        // Two stages on one GPU share it.
        let w = gpu_warning(&stages, &[200 * GB]).expect("250 GB on one GPU");
        assert!(w.contains("for the stages it holds"), "{w}");
        // A pool the stage sizes itself counts nothing here.
        let own = [StageMemory { stage: 0, weights: 100 * GB, pool: None }];
        assert_eq!((gpu_error(&own, &free), gpu_warning(&own, &free)), (None, None));
        assert!(
            gpu_error(&[StageMemory { stage: 0, weights: 250 * GB, pool: None }], &free).is_some_and(|e| e.contains("its weights need"))
        );
        assert_eq!((gpu_error(&stages, &[]), gpu_warning(&stages, &[])), (None, None), "no GPU seen: nothing said");
    }

    #[test]
    fn nvidia_smis_free_memory_lines_are_read() {
        assert_eq!(parse_free_mib("81004\n 80990 \n"), Some(vec![81004 << 20, 80990 << 20]));
        assert_eq!(parse_free_mib("No devices were found\n"), None);
        assert_eq!(parse_free_mib(""), None);
    }
}
