//! Starting a compiled OUT folder's stages under mpirun, for `m3c run` and
//! `m3c serve`: the manifest read and every executable checked against it
//! (here), then one rank per stage on the plan's hosts, every stage with
//! the same arguments ([`mpirun`]), a job that spans hosts checked host by
//! host first ([`preflight`]), and a failed job's end read and reaped
//! ([`job_end`]). Where ranks run (the plan's hosts, or a placement per
//! replica with each rank's `--node-share`) is `placement`'s; a job's
//! memory against the machine's, before mpirun starts, is [`memory`]'s.

mod job_end;
pub mod memory;
mod mpirun;
mod placement;
mod preflight;

pub use job_end::{reap_after_error, JobEnd, StageLog};
pub use mpirun::spawn_error;
pub use placement::Placement;

use anyhow::{bail, Context, Result};
use m3c_contract::manifest::{sha256_hex, Manifest};
use m3c_contract::stage_args::StageArgs;
use std::path::{Path, PathBuf};

/// How mpirun places and connects the ranks beyond the plan's hosts: a
/// hostfile (Open MPI's format) and extra mpirun options, from
/// `M3C_MPIRUN_ARGS` (split at whitespace) and then each `--mpirun-arg`.
/// `OMPI_MCA_*` variables in the environment reach mpirun as they are.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Launch {
    pub hostfile: Option<PathBuf>,
    pub mpirun_args: Vec<String>,
    /// The network interface (or subnet, `10.0.0.0/24`) the stages talk
    /// over: Open MPI's TCP traffic and NCCL's sockets.
    pub iface: Option<String>,
}

impl Launch {
    /// The launch of `--hostfile` and `--mpirun-arg`s, with
    /// `M3C_MPIRUN_ARGS` first; a hostfile that cannot be read is an error
    /// naming it.
    pub fn new(hostfile: Option<PathBuf>, mpirun_args: &[String], iface: Option<String>) -> Result<Launch> {
        if let Some(f) = &hostfile {
            std::fs::File::open(f).with_context(|| format!("--hostfile {}: cannot be read", f.display()))?;
        }
        let env = std::env::var("M3C_MPIRUN_ARGS").unwrap_or_default();
        let mpirun_args = env.split_ascii_whitespace().map(str::to_string).chain(mpirun_args.iter().cloned()).collect();
        if let Some(i) = &iface {
            if i.is_empty() || !i.chars().all(|c| c.is_ascii_alphanumeric() || ".-_:/@".contains(c)) {
                bail!("--iface `{i}`: expected a network interface name (eth0) or a subnet (10.0.0.0/24)");
            }
        }
        Ok(Launch { hostfile, mpirun_args, iface })
    }
}

/// A compiled OUT folder whose executables are the ones its manifest lists.
pub struct Compiled {
    pub out: PathBuf,
    pub manifest: Manifest,
    pub stages: usize,
}

impl Compiled {
    /// Reads OUT's manifest and checks each stage's sha256 against it, and
    /// that `model` is a folder.
    pub fn open(out: &Path, model: &Path) -> Result<Compiled> {
        let file = out.join("manifest.json");
        let text = m3c_contract::read_user_file(&file, "manifest", 64 << 20).with_context(|| {
            format!("{}: not an m3c output folder (no readable manifest.json); make one with `m3c compile`", out.display())
        })?;
        let manifest = Manifest::parse(&text).with_context(|| format!("{}: cannot be used", file.display()))?;
        if !model.is_dir() {
            bail!("--model {}: not a folder (expected the checkpoint folder with config.json and safetensors)", model.display());
        }
        // Each executable must be the one compiled: a damaged or swapped file
        // would otherwise surface as a crash ("exit status 139") mid-job.
        let stages = manifest.stages.iter().enumerate().map(|(k, e)| (format!("stage-{k}"), &e.sha256));
        for (name, sha) in stages.chain(manifest.encoder.iter().map(|e| (e.executable.clone(), &e.sha256))) {
            let exe = out.join(&name);
            let bytes = m3c_contract::input::read_bytes(&exe, "stage executable", 16 << 30)
                .with_context(|| format!("{}: missing or unreadable; recompile {}", exe.display(), out.display()))?;
            if sha256_hex(&bytes) != *sha {
                bail!(
                    "{}: is not the executable manifest.json lists (its sha256 differs: damaged or replaced); recompile {}",
                    exe.display(),
                    out.display()
                );
            }
        }
        // The config the stages were compiled from: each stage checks it at
        // start, in these words; said here, it comes before mpirun's.
        m3c_contract::manifest::check_config(model, &manifest.config_sha256).map_err(anyhow::Error::msg)?;
        let stages = manifest.stages.len();
        Ok(Compiled { out: out.to_path_buf(), manifest, stages })
    }

    /// The GPU flags against the build: host stages have no device graphs
    /// or vendor GEMMs, so asking for either there is an error that says
    /// so, not a flag silently dropped.
    pub fn check_gpu_modes(&self, modes: m3c_contract::stage_args::GpuModes) -> Result<()> {
        if self.manifest.target != m3c_contract::target::Target::Host {
            return Ok(());
        }
        let asked = [(modes.prefill_gemm_vendor, "--prefill-gemm vendor"), (!modes.graphs, "--graphs off")];
        if let Some((_, flag)) = asked.iter().find(|(on, _)| *on) {
            bail!(
                "{flag}: {} is compiled for the host (`target: host`), whose stages have no device graphs or vendor GEMMs; \
                 the flag applies to stages compiled with --target cuda or rocm",
                self.out.display()
            );
        }
        Ok(())
    }

    /// The stages' memory on this machine against what it has, before
    /// mpirun starts ([`memory`]): each stage's weights (its tensors' bytes
    /// in `model`) and its KV pool of `pool_positions` (`None`: the stages
    /// size it from their free memory). Host stages whose pools exceed the
    /// available memory get a warning; a CUDA stage that cannot fit its
    /// no GPU here could hold (nvidia-smi) is an error, and one that would
    /// not fit the GPU it takes by default a warning. A job that spans
    /// hosts is not judged from here.
    pub fn check_memory(&self, model: &Path, pool_positions: Option<u64>, launch: &Launch) -> Result<()> {
        if self.spans_hosts(launch) {
            return Ok(());
        }
        let layout = m3c_contract::CheckpointLayout::open(model).map_err(|e| anyhow::anyhow!("{e}"))?;
        let per_position = self.cache_bytes_per_position();
        let stages: Vec<memory::StageMemory> = self
            .manifest
            .stages
            .iter()
            .enumerate()
            .map(|(k, e)| memory::StageMemory {
                stage: k,
                weights: e.tensors.iter().filter_map(|t| layout.tensors.get(t)).map(|t| t.end - t.start).sum(),
                pool: pool_positions.map(|p| per_position.get(k).copied().unwrap_or(0) * p),
            })
            .collect();
        match self.manifest.target {
            m3c_contract::target::Target::Host => {
                if let Some(w) = memory::host_available().and_then(|a| memory::host_warning(&stages, a)) {
                    eprintln!("{w}");
                }
            }
            m3c_contract::target::Target::Cuda { .. } => {
                if let Some(free) = memory::nvidia_free() {
                    if let Some(e) = memory::gpu_error(&stages, &free) {
                        bail!("{e}");
                    }
                    if let Some(w) = memory::gpu_warning(&stages, &free) {
                        eprintln!("{w}");
                    }
                }
            }
            // ROCm's free memory would come from rocm-smi; the stage's own
            // allocation error still names the stage.
            m3c_contract::target::Target::Rocm { .. } => {}
        }
        Ok(())
    }

    /// An EAGLE3 draft a run or server names, checked before mpirun starts
    /// as the last stage would check it: the stages hold a head compiled
    /// from this draft's config, and its safetensors headers read (the
    /// tensors and their sizes).
    pub fn check_speculation(&self, spec: Option<&m3c_contract::speculative::SpeculativeConfig>) -> Result<()> {
        let Some(m3c_contract::speculative::SpeculativeConfig::Eagle3 { model, .. }) = spec else { return Ok(()) };
        m3c_contract::manifest::check_draft_config(model, self.manifest.draft_config_sha256.as_deref()).map_err(anyhow::Error::msg)?;
        m3c_contract::CheckpointLayout::open(model).map_err(|e| anyhow::anyhow!("EAGLE3 draft {}: {e}", model.display()))?;
        Ok(())
    }

    /// Whether the first stage encodes images (it holds the vision tower).
    pub fn encodes_images(&self) -> bool {
        self.manifest.encodes_images()
    }

    /// Cache bytes per position of each stage (every cache row of a
    /// sequence), from the manifest's cache slots.
    pub fn cache_bytes_per_position(&self) -> Vec<u64> {
        self.manifest.cache_bytes_per_position()
    }

    /// `mpirun` over the stages, each given `stage`'s arguments; mpirun
    /// dies with this process (even by SIGKILL) and takes its ranks with
    /// it. A job that spans hosts has them checked first
    /// ([`Compiled::preflight`], within the stages' `--timeout-s`).
    pub fn mpirun(&self, stage: &StageArgs, launch: &Launch) -> Result<std::process::Command> {
        self.mpirun_placed(stage, launch, &self.placement())
    }

    /// [`Compiled::mpirun`] with the ranks on `placement` (one replica of
    /// several): each rank also told its share of its machine.
    pub fn mpirun_placed(&self, stage: &StageArgs, launch: &Launch, placement: &Placement) -> Result<std::process::Command> {
        if let (true, Some(model)) = (self.spans_hosts(launch), stage.weights.checkpoint()) {
            self.preflight(model, launch, placement, std::time::Duration::from_secs_f64(stage.timeout_s))?;
        }
        let args = stage.to_args();
        Ok(self.mpirun_each(launch, placement, |k, cmd| {
            cmd.arg(self.executable(k)).args(&args);
            if let Some(share) = placement.shares.get(k).copied().flatten() {
                cmd.arg("--node-share").arg(share.to_string());
            }
        }))
    }

    /// The executable of rank `k`: a stage's, or after the stages the
    /// encoder ranks' (a plan's `vision: {ranks: N}`).
    pub fn executable(&self, k: usize) -> PathBuf {
        match (&self.manifest.encoder, k >= self.stages) {
            (Some(e), true) => self.out.join(&e.executable),
            _ => self.out.join(format!("stage-{k}")),
        }
    }

    /// Ranks of the job: the stages, then the encoder ranks.
    pub fn ranks(&self) -> usize {
        self.stages + self.manifest.encoder.as_ref().map_or(0, |e| e.hosts.len())
    }

    /// The host the plan names for rank `k`, if any.
    pub fn rank_host(&self, k: usize) -> Option<&String> {
        match self.manifest.stages.get(k) {
            Some(s) => s.host.as_ref(),
            None => self.manifest.encoder.as_ref().and_then(|e| e.hosts.get(k - self.stages)).and_then(Option::as_ref),
        }
    }

    /// The stages placed on `node` (a plan host, or by the launch's
    /// hostfile filled in order, slot by slot).
    pub fn stages_on(&self, node: &str, launch: &Launch) -> Vec<usize> {
        let by_file = launch.hostfile.as_deref().and_then(hostfile_slots).unwrap_or_default();
        (0..self.stages)
            .filter(|&k| match &self.manifest.stages[k].host {
                Some(h) => h == node,
                None => by_file.get(k).is_some_and(|h| h == node),
            })
            .collect()
    }

    /// Whether the job may leave this machine: a stage names a host, or
    /// the launch places ranks (a hostfile, or mpirun's own host options).
    pub fn spans_hosts(&self, launch: &Launch) -> bool {
        (0..self.ranks()).any(|k| self.rank_host(k).is_some())
            || launch.hostfile.is_some()
            || launch
                .mpirun_args
                .iter()
                .any(|a| ["--host", "-H", "--hostfile", "--machinefile", "--default-hostfile"].contains(&a.as_str()))
    }
}

/// The host of each slot of an Open MPI hostfile (`HOST slots=N` lines),
/// in the file's order: where its default mapping puts each rank when
/// mpirun's own node is listed first or not at all (it fills its own node
/// first); `None` when a line gives no slot count (mpirun would count the
/// host's cores).
fn hostfile_slots(file: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut out = Vec::new();
    for line in text.lines().map(|l| l.split('#').next().unwrap_or("").trim()).filter(|l| !l.is_empty()) {
        let mut words = line.split_whitespace();
        let host = words.next()?;
        let slots: usize = words.find_map(|w| w.strip_prefix("slots=")).and_then(|n| n.parse().ok())?;
        out.extend(std::iter::repeat_n(host.to_string(), slots.min(1 << 16)));
    }
    Some(out)
}
