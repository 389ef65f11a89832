//! This rank's place on its machine: which GPU it takes by default and
//! what share of the cores and free memory is its own. Open MPI's local
//! rank and size say it for one job; several pipelines on one machine
//! (`m3c serve --data-parallel-size`) are several jobs, so the front tells
//! each rank its place among all of them (`--node-share`).

use m3c_contract::stage_args::NodeShare;
use std::sync::OnceLock;

static SHARE: OnceLock<Option<NodeShare>> = OnceLock::new();

/// Records the stage arguments' `--node-share` (the first call wins).
pub fn set(share: Option<NodeShare>) {
    let _ = SHARE.set(share);
}

/// (this rank's index among the ranks on its machine, how many there are).
pub fn local() -> (usize, usize) {
    if let Some(s) = SHARE.get().copied().flatten() {
        return (s.offset, s.total.max(1));
    }
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    (var("OMPI_COMM_WORLD_LOCAL_RANK").unwrap_or(0), var("OMPI_COMM_WORLD_LOCAL_SIZE").unwrap_or(1).max(1))
}
