//! Where a pipeline's ranks run: the plan's hosts for one pipeline, and for
//! `m3c serve --data-parallel-size N` one placement per replica, each on
//! hosts of its own where a hostfile lists enough slots, else all on this
//! machine. Ranks of several replicas that share a machine are told their
//! place among all of them (`--node-share`), so that they take different
//! GPUs and share the cores instead of each taking all of them.

use super::{hostfile_slots, Compiled, Launch};
use anyhow::{bail, Result};
use m3c_contract::stage_args::NodeShare;

/// Where one pipeline's ranks (its stages, then its encoder ranks) run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Per rank: the host mpirun puts it on (`None`: mpirun's default).
    pub hosts: Vec<Option<String>>,
    /// Per rank: its place among every replica's ranks on its machine
    /// (`None`: it shares the machine only with its own job's ranks).
    pub shares: Vec<Option<NodeShare>>,
}

impl Compiled {
    /// One pipeline as the plan places it.
    pub fn placement(&self) -> Placement {
        let ranks = self.ranks();
        Placement { hosts: (0..ranks).map(|k| self.rank_host(k).cloned()).collect(), shares: vec![None; ranks] }
    }

    /// `n` pipelines of this build. With a hostfile, replica `r`'s rank `k`
    /// takes the hostfile's slot `r·ranks + k` (the file's hosts in order,
    /// each as many times as its `slots=`), so replicas fill hosts in turn;
    /// without one, every replica runs on this machine. A plan that names
    /// hosts has one place for each stage, so it cannot hold `n > 1`.
    pub fn replica_placements(&self, n: usize, launch: &Launch) -> Result<Vec<Placement>> {
        if n <= 1 {
            return Ok(vec![self.placement()]);
        }
        let ranks = self.ranks();
        if let Some((k, h)) = (0..ranks).find_map(|k| self.rank_host(k).map(|h| (k, h))) {
            bail!(
                "--data-parallel-size {n}: the plan puts rank {k} on host `{h}`, one place for one pipeline; \
                 compile a plan without hosts and give a --hostfile with {} slots ({n} replicas of {ranks} ranks)",
                n * ranks
            );
        }
        if let Some(a) =
            launch.mpirun_args.iter().find(|a| ["--host", "-H", "--hostfile", "--machinefile", "--default-hostfile"].contains(&a.as_str()))
        {
            bail!("--data-parallel-size {n}: the mpirun option `{a}` places every replica's ranks alike; list the hosts in --hostfile instead");
        }
        let hosts: Vec<Option<String>> = match &launch.hostfile {
            None => vec![None; n * ranks],
            Some(f) => {
                let Some(slots) = hostfile_slots(f) else {
                    bail!("--hostfile {}: every line needs `slots=N` to place {n} replicas", f.display())
                };
                if slots.len() < n * ranks {
                    bail!(
                        "--hostfile {} lists {} slots; --data-parallel-size {n} needs {} ({n} replicas of {ranks} ranks)",
                        f.display(),
                        slots.len(),
                        n * ranks
                    );
                }
                slots.into_iter().take(n * ranks).map(Some).collect()
            }
        };
        let shares = node_shares(&hosts);
        Ok((0..n)
            .map(|r| Placement { hosts: hosts[r * ranks..(r + 1) * ranks].to_vec(), shares: shares[r * ranks..(r + 1) * ranks].to_vec() })
            .collect())
    }
}

impl Compiled {
    /// The host each rank of `placement` runs on, where it is known: its
    /// own, else the hostfile's slot of that rank (Open MPI's default
    /// mapping), else `None` (mpirun's choice, this machine).
    pub fn rank_hosts(&self, placement: &Placement, launch: &Launch) -> Vec<Option<String>> {
        let by_file = launch.hostfile.as_deref().and_then(hostfile_slots).unwrap_or_default();
        (0..self.ranks()).map(|k| placement.hosts.get(k).cloned().flatten().or_else(|| by_file.get(k).cloned())).collect()
    }

    /// Replica `r` of `current` (each replica's hosts now, one replica for
    /// a lone pipeline) placed by the hostfile again, avoiding the `lost`
    /// hosts: on the hostfile's first slots that are neither lost nor held
    /// by another replica (the spare hosts listed after the ones in use
    /// take the lost one's place). A host another replica uses is taken
    /// only as far as this replica held it already, so no replica's share
    /// of a machine changes under it. `None` when there is no such
    /// placement: no hostfile, a plan that names hosts, or too few slots.
    pub fn avoiding(&self, launch: &Launch, lost: &[String], current: &[Vec<Option<String>>], r: usize) -> Option<Placement> {
        let ranks = self.ranks();
        if (0..ranks).any(|k| self.rank_host(k).is_some()) {
            return None;
        }
        avoiding(hostfile_slots(launch.hostfile.as_deref()?)?, ranks, lost, current, r)
    }
}

/// [`Compiled::avoiding`] on the hostfile's `slots` for `ranks` ranks a replica.
fn avoiding(mut free: Vec<String>, ranks: usize, lost: &[String], current: &[Vec<Option<String>>], r: usize) -> Option<Placement> {
    let others: Vec<&String> = current.iter().enumerate().filter(|(q, _)| *q != r).flat_map(|(_, h)| h.iter().flatten()).collect();
    for h in &others {
        if let Some(i) = free.iter().position(|f| f == *h) {
            free.remove(i);
        }
    }
    let held = |h: &String| current.get(r).map_or(0, |own| own.iter().flatten().filter(|o| *o == h).count());
    let mut hosts: Vec<Option<String>> = Vec::with_capacity(ranks);
    for h in free {
        let shared = others.contains(&&h);
        let taken = hosts.iter().flatten().filter(|t| **t == h).count();
        if hosts.len() < ranks && !lost.contains(&h) && (!shared || taken < held(&h)) {
            hosts.push(Some(h));
        }
    }
    if hosts.len() < ranks {
        return None;
    }
    // A lone pipeline shares its machines with nobody; replicas learn
    // their places among all replicas' ranks, as at start-up.
    let shares = if current.len() <= 1 {
        vec![None; ranks]
    } else {
        let all: Vec<Option<String>> =
            current.iter().enumerate().flat_map(|(q, h)| if q == r { hosts.clone() } else { h.clone() }).collect();
        node_shares(&all)[r * ranks..(r + 1) * ranks].to_vec()
    };
    Some(Placement { hosts, shares })
}

/// Each rank's place among the ranks on its machine (`None` is this one).
fn node_shares(hosts: &[Option<String>]) -> Vec<Option<NodeShare>> {
    hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let offset = hosts[..i].iter().filter(|o| *o == h).count();
            let total = hosts.iter().filter(|o| *o == h).count();
            Some(NodeShare { offset, total })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two replicas of two ranks on the slots `a b a c d`: replica 0 on
    /// (a, b), replica 1 on (a, c), both on machine `a`, `d` a spare.
    #[test]
    fn a_replica_that_lost_a_host_takes_a_spare_and_no_other_replicas_slot() {
        let slots: Vec<String> = ["a", "b", "a", "c", "d"].map(String::from).to_vec();
        let hosts = |h: &[&str]| h.iter().map(|h| Some(h.to_string())).collect::<Vec<_>>();
        let shares = |p: &Placement| p.shares.iter().map(|s| s.map(|s| (s.offset, s.total))).collect::<Vec<_>>();
        let current = vec![hosts(&["a", "b"]), hosts(&["a", "c"])];
        // Replica 1 loses c: it keeps its place on a (the second of two)
        // and takes the spare d.
        let moved = avoiding(slots.clone(), 2, &["c".into()], &current, 1).expect("a spare");
        assert_eq!((moved.hosts.clone(), shares(&moved)), (hosts(&["a", "d"]), vec![Some((1, 2)), Some((0, 1))]));
        // Then replica 0 loses b: d is replica 1's now, c is free, and a
        // stays shared as before.
        let current = vec![current[0].clone(), moved.hosts];
        let moved = avoiding(slots.clone(), 2, &["b".into()], &current, 0).expect("c");
        assert_eq!((moved.hosts.clone(), shares(&moved)), (hosts(&["a", "c"]), vec![Some((0, 2)), Some((0, 1))]));
        // With b and c lost there is no room that is not another's.
        assert_eq!(avoiding(slots.clone(), 2, &["b".into(), "c".into()], &current, 0), None);
        // A lone pipeline takes the first free slots, telling no rank a share.
        let lone = avoiding(slots, 2, &["b".into()], &current[..1], 0).expect("a and a");
        assert_eq!((lone.hosts.clone(), shares(&lone)), (hosts(&["a", "a"]), vec![None, None]));
    }

    #[test]
    fn ranks_on_one_machine_are_numbered_across_replicas() {
        let local = node_shares(&[None, None, None, None]);
        assert_eq!(local.iter().map(|s| s.unwrap().offset).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert!(local.iter().all(|s| s.unwrap().total == 4));
        let two = node_shares(&[Some("a".into()), Some("b".into()), Some("a".into()), Some("b".into())]);
        assert_eq!(two.iter().map(|s| (s.unwrap().offset, s.unwrap().total)).collect::<Vec<_>>(), [(0, 2), (0, 2), (1, 2), (1, 2)]);
    }
}
