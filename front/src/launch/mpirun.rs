//! The mpirun command line of a job: placement, interfaces, keepalives,
//! one app context per stage, and a launcher that dies with its parent.

use super::{Compiled, Launch, Placement};

impl Compiled {
    /// `mpirun` with the launch's options and each rank on `placement`'s
    /// host, one app context per rank that `program` fills in (the program
    /// and its arguments).
    pub(super) fn mpirun_each(
        &self,
        launch: &Launch,
        placement: &Placement,
        program: impl Fn(usize, &mut std::process::Command),
    ) -> std::process::Command {
        crate::mpi_sessions::sweep_mine();
        let mut cmd = std::process::Command::new("mpirun");
        // No core binding: each rank runs its kernels on several threads (the
        // runtime shares the node's cores among its ranks).
        cmd.args(["--oversubscribe", "--bind-to", "none"]);
        if let Some(f) = &launch.hostfile {
            cmd.arg("--hostfile").arg(f);
        }
        if let Some(i) = &launch.iface {
            cmd.args(["--mca", "btl_tcp_if_include", i, "--mca", "oob_tcp_if_include", i]);
            // NCCL takes interface names, not subnets.
            if !i.contains('/') {
                cmd.args(["-x", &format!("NCCL_SOCKET_IFNAME={i}")]);
            }
        }
        cmd.args(&launch.mpirun_args);
        // A session folder of its own, so that no other job's end removes
        // it while this one starts (mpi_sessions), unless the user chose
        // one. Only for a job on this machine: the path is this machine's
        // temporary folder, which another host may not have (its daemons
        // would take it as theirs).
        let chosen =
            std::env::var_os("OMPI_MCA_orte_tmpdir_base").is_some() || launch.mpirun_args.iter().any(|a| a.contains("orte_tmpdir_base"));
        if !chosen && !self.spans_hosts(launch) {
            cmd.args(["--mca", "orte_tmpdir_base"]).arg(crate::mpi_sessions::launch_base());
        }
        if is_root() {
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        // Open MPI's daemons learn that a host is gone from TCP keepalives,
        // after 8 minutes by default: a host cut off would keep its daemon
        // (and the job) waiting that long. Seconds instead, unless the user
        // set them.
        for (k, v) in [
            ("OMPI_MCA_oob_tcp_keepalive_time", "5"),
            ("OMPI_MCA_oob_tcp_keepalive_intvl", "2"),
            ("OMPI_MCA_oob_tcp_keepalive_probes", "3"),
        ] {
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
        // The stages, then the encoder ranks (a plan's `vision: {ranks: N}`).
        for k in 0..self.ranks() {
            if k > 0 {
                cmd.arg(":");
            }
            cmd.args(["-np", "1"]);
            // Manifest::parse checked that a plan's host is a host name,
            // and hostfile_slots took a hostfile's first word.
            if let Some(host) = placement.hosts.get(k).and_then(Option::as_ref) {
                cmd.args(["--host", host]);
            }
            program(k, &mut cmd);
        }
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe, as a pre_exec hook requires.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        cmd
    }
}

/// What a failed `spawn` of mpirun means to a user.
pub fn spawn_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        anyhow::anyhow!("`mpirun` not found: install Open MPI (`apt install openmpi-bin`, or run scripts/setup.sh)")
    } else {
        anyhow::Error::new(e).context("cannot start mpirun")
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
