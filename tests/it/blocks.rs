//! The KV block pool's allocator (`m3c_contract::blocks`), property-tested
//! against a model written the plainest way: a list of blocks scanned in
//! full on every call.

use m3c_contract::blocks::{BlockHash, BlockId};
use m3c_kvpool::BlockPool;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    /// Release the k-th held reference (mod how many there are).
    Release(usize),
    /// Commit the k-th held reference's block with hash n.
    Commit(usize, u8),
    Lookup(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Alloc),
        3 => any::<usize>().prop_map(Op::Release),
        2 => (any::<usize>(), 0u8..6).prop_map(|(k, n)| Op::Commit(k, n)),
        2 => (0u8..6).prop_map(Op::Lookup),
    ]
}

/// Per block: references, cached hash, release time.
#[derive(Debug, Clone, Default)]
struct Plain {
    blocks: Vec<(u32, Option<u8>, u64)>,
    clock: u64,
}

impl Plain {
    fn alloc(&mut self) -> Option<BlockId> {
        let free = self.blocks.iter().position(|b| b.0 == 0 && b.1.is_none());
        let idle = || self.blocks.iter().enumerate().filter(|(_, b)| b.0 == 0 && b.1.is_some()).min_by_key(|(_, b)| b.2).map(|(i, _)| i);
        let i = free.or_else(idle)?;
        self.blocks[i] = (1, None, 0);
        Some(i as BlockId)
    }
    fn lookup(&mut self, n: u8) -> Option<BlockId> {
        let i = self.blocks.iter().position(|b| b.1 == Some(n))?;
        self.blocks[i].0 += 1;
        Some(i as BlockId)
    }
    fn commit(&mut self, id: BlockId, n: u8) {
        let known = self.blocks.iter().any(|b| b.1 == Some(n));
        let b = &mut self.blocks[id as usize];
        if b.0 > 0 && b.1.is_none() && !known {
            b.1 = Some(n);
        }
    }
    fn release(&mut self, id: BlockId) {
        self.clock += 1;
        let b = &mut self.blocks[id as usize];
        b.0 -= 1;
        b.2 = self.clock;
    }
}

fn hash(n: u8) -> BlockHash {
    BlockHash::chain(None, &[n as i64], &[])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every call gives the model's answer, counts add up, and a block is
    /// never handed out while someone holds it.
    #[test]
    fn the_pool_allocates_shares_and_evicts_as_the_plain_model(total in 1usize..7, ops in proptest::collection::vec(op(), 0..80)) {
        let mut pool = BlockPool::new(total);
        let mut plain = Plain { blocks: vec![(0, None, 0); total], clock: 0 };
        let mut held: Vec<BlockId> = Vec::new();
        for o in ops {
            match o {
                Op::Alloc => {
                    let got = pool.alloc();
                    prop_assert_eq!(got, plain.alloc());
                    if let Some(id) = got {
                        prop_assert!(!held.contains(&id), "block {} handed out twice", id);
                        held.push(id);
                    }
                }
                Op::Release(k) if !held.is_empty() => {
                    let id = held.remove(k % held.len());
                    pool.release(id);
                    plain.release(id);
                }
                Op::Commit(k, n) if !held.is_empty() => {
                    let id = held[k % held.len()];
                    pool.commit(id, hash(n));
                    plain.commit(id, n);
                }
                Op::Lookup(n) => {
                    let got = pool.lookup(&hash(n));
                    prop_assert_eq!(got, plain.lookup(n));
                    held.extend(got);
                }
                _ => {}
            }
            let in_use = plain.blocks.iter().filter(|b| b.0 > 0).count();
            prop_assert_eq!(pool.in_use(), in_use);
            prop_assert_eq!(pool.available(), total - in_use);
            prop_assert_eq!(pool.cached(), plain.blocks.iter().filter(|b| b.1.is_some()).count());
            for id in 0..total as BlockId {
                prop_assert_eq!(pool.refs(id), plain.blocks[id as usize].0);
            }
        }
        // Every way out returns the blocks: only idle cached ones stay.
        for id in held.drain(..) {
            pool.release(id);
        }
        prop_assert_eq!(pool.in_use(), 0);
        prop_assert_eq!(pool.available(), total);
        prop_assert_eq!(pool.cached_idle(), pool.cached());
    }
}
