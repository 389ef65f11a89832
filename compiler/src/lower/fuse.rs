//! Fusion: the stage's graph nodes become kernel calls. The patterns:
//! - per-head RMSNorm → RoPE: one `HeadNormRope` call;
//! - a cache append becomes a per-sequence row copy after the producer (the
//!   producer runs once over all rows of the micro-batch, each sequence's
//!   rows then go to its own cache);
//! - index scores → block max → top-k blocks → attention: one attention call
//!   with the MSA selection inside;
//! - a residual add whose first operand dies there runs in place;
//! - router and routed experts are one call each; the experts' weights are a
//!   pointer table, not 3×E arguments.

use super::{cache_kind_name, Boundary, CacheSlot, Storages, TensorSlot};
use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::graph::{CacheKind, Dim, ModelGraph, Op};
use crate::model::names;
use crate::model::{expected_tensors, Part, TensorSpec};
use m3c_kernels::{expert_tensor_types, Kernel, MemTy, SparseSel, Storage, WeightType};
use petgraph::graph::NodeIndex;
use petgraph::Direction;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

/// An operand of a kernel call in the stage entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    /// The stage's activation rows `[S, hidden]`: its input, and (in place) its output.
    X,
    /// This step's token ids `[S]`.
    Ids,
    /// This step's positions `[S]`.
    Pos,
    /// A scratch buffer `[S, width]` of `elem`.
    Buf { id: usize, width: usize, elem: &'static str },
    /// A weight from the pointer table.
    Weight { slot: usize, ty: MemTy },
    /// A pointer into the weight table: the first of a layer's expert tensors.
    ExpertTable { first_slot: usize },
    /// A cache slot's whole pool `[blocks × kv_block, width]` of `cache`'s
    /// type; kernels reach a sequence's rows through its block table and
    /// positions read from `pos`, so no call depends on the position.
    Cache { slot: usize, width: usize, cache: Storage },
    /// The sequence's block table `[capacity / kv_block]`: the pool block
    /// that holds each of its blocks of positions.
    BlockTable,
    /// The logits output `[S, vocab]`.
    Logits { vocab: usize },
    /// The sampled ids `[S]`.
    OutIds,
    /// The sampling table `[S, ROW_WORDS]` (parameters in, non-finite counts out).
    Table,
    /// The seen-id bitmaps of the repetition penalty, one row per sequence.
    Seen { words: usize },
    /// The bias rows added to the logits of the rows that name one
    /// (`logit_bias`, presence and frequency penalties) `[B, vocab]`.
    Bias { vocab: usize },
    /// Vision entry: the images' normalised patch rows `[P, row]` f32.
    Pixels { row: usize },
    /// Vision entry: each patch row's `(t, h, w)` `[P, 3]`.
    PatchPos,
    /// Vision entry: each patch row's last row within its image `[P]`.
    Segments,
    /// Step entry: the image features of this step's placeholder rows `[K, hidden]`.
    Img,
    /// Step entry: the row of `x` each `Img` row replaces `[K]`.
    ImgRows,
    /// Step entry: the EAGLE3 aux states, one `[S, hidden]` slab per slot
    /// (`slot`); the draft's first entry: each row's slabs concatenated
    /// (`slot` None, `[S, width]`).
    Aux { slot: Option<usize>, width: usize },
}

impl Arg {
    /// The memref type the argument has in the entry (`act`: how activations are stored).
    pub fn mem_ty(&self, hidden: usize, act: Storage) -> Option<MemTy> {
        Some(match self {
            Arg::X => MemTy::rows(hidden, act.mlir_elem()),
            Arg::Ids | Arg::Pos | Arg::OutIds | Arg::BlockTable => MemTy { dims: vec![None], elem: "i64" },
            Arg::ExpertTable { .. } => return None,
            Arg::Buf { width, elem, .. } => MemTy::rows(*width, elem),
            Arg::Weight { ty, .. } => ty.clone(),
            Arg::Cache { width, cache, .. } => MemTy::rows(*width, cache.mlir_elem()),
            Arg::Logits { vocab } => MemTy::rows(*vocab, "f32"),
            Arg::Table => MemTy::rows(m3c_contract::sampling::ROW_WORDS, "i64"),
            Arg::Seen { words } => MemTy::rows(*words, "i32"),
            Arg::Bias { vocab } => MemTy::rows(*vocab, "f32"),
            Arg::Pixels { row } => MemTy::rows(*row, "f32"),
            Arg::PatchPos => MemTy::rows(3, "i64"),
            Arg::Segments | Arg::ImgRows => MemTy { dims: vec![None], elem: "i64" },
            Arg::Img => MemTy::rows(hidden, act.mlir_elem()),
            Arg::Aux { width, .. } => MemTy::rows(*width, act.mlir_elem()),
        })
    }
}

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::X => f.write_str("x"),
            Arg::Ids => f.write_str("ids"),
            Arg::Pos => f.write_str("pos"),
            Arg::Buf { id, .. } => write!(f, "b{id}"),
            Arg::Weight { slot, .. } => write!(f, "w{slot}"),
            Arg::ExpertTable { first_slot } => write!(f, "&w{first_slot}"),
            Arg::Cache { slot, .. } => write!(f, "cache{slot}"),
            Arg::BlockTable => f.write_str("blocks"),
            Arg::Logits { .. } => f.write_str("logits"),
            Arg::OutIds => f.write_str("out_ids"),
            Arg::Table => f.write_str("table"),
            Arg::Seen { .. } => f.write_str("seen"),
            Arg::Bias { .. } => f.write_str("bias"),
            Arg::Pixels { .. } => f.write_str("pixels"),
            Arg::PatchPos => f.write_str("patch_pos"),
            Arg::Segments => f.write_str("segments"),
            Arg::Img => f.write_str("img"),
            Arg::ImgRows => f.write_str("img_rows"),
            Arg::Aux { slot: Some(s), .. } => write!(f, "aux{s}"),
            Arg::Aux { slot: None, .. } => f.write_str("aux"),
        }
    }
}

/// One statement of the stage entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A scratch buffer `[S, width]` comes to life.
    Alloc { id: usize, width: usize, elem: &'static str },
    /// Buffers of a finished part are freed.
    Free { id: usize, width: usize, elem: &'static str },
    /// A kernel call over all rows of the step, or (`per_sequence`) once per
    /// sequence of the micro-batch, over that sequence's rows, positions and caches.
    Call { kernel: Kernel, args: Vec<Arg>, what: String, per_sequence: bool },
    /// The stage's result was not computed in place: copy it to `x`.
    CopyToX { id: usize, width: usize },
    /// Buffer `from` (`[S, width]`) viewed as `to` (`[S/factor, factor·width]`);
    /// later buffers have `S/factor` rows (the vision entry's 2×2 merge).
    Regroup { from: usize, to: usize, width: usize, factor: usize, elem: &'static str },
    /// A call over the `K` image rows of the step, made only when there are some.
    ImageRows { kernel: Kernel, args: Vec<Arg>, what: String },
    /// `x` (or buffer `from`) copied to EAGLE3 aux slab `slot` (`[S, width]`).
    CopyAux { from: Option<usize>, slot: usize, width: usize },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Alloc { id, width, elem } => write!(f, "  b{id} = alloc [S, {width}] {elem}"),
            Step::Free { id, .. } => write!(f, "  free b{id}"),
            Step::Call { kernel, args, what, per_sequence } => {
                let a: Vec<String> = args.iter().map(|a| a.to_string()).collect();
                let each = if *per_sequence { "each sequence: " } else { "" };
                write!(f, "  {each}{}({})  # {what}", kernel.symbol(), a.join(", "))
            }
            Step::CopyToX { id, .. } => write!(f, "  x = copy b{id}"),
            Step::Regroup { from, to, width, factor, .. } => write!(f, "  b{to} = b{from} as [S/{factor}, {}]", width * factor),
            Step::CopyAux { from, slot, .. } => match from {
                Some(id) => write!(f, "  aux{slot} = copy b{id}"),
                None => write!(f, "  aux{slot} = copy x"),
            },
            Step::ImageRows { kernel, args, what } => {
                let a: Vec<String> = args.iter().map(|a| a.to_string()).collect();
                write!(f, "  image rows: {}({})  # {what}", kernel.symbol(), a.join(", "))
            }
        }
    }
}

/// A stage as one fused program per entry, over one set of weights,
/// caches and kernels: what a back end turns into code.
#[derive(Debug, Clone)]
pub struct FusedStage {
    pub hidden: usize,
    /// How activations (`x` and the scratch rows between kernels) are stored.
    pub act: Storage,
    pub tensors: Vec<TensorSlot>,
    pub caches: Vec<CacheSlot>,
    /// Positions per cache block (the model's MSA block).
    pub kv_block: usize,
    /// Every kernel the entries call, each once.
    pub kernels: Vec<Kernel>,
    /// The step entry: token ids or hidden rows in, hidden rows or logits out.
    pub text: TextProgram,
    /// The vision entry's steps (patch rows in, merged image features out
    /// in `x`), when the stage holds the vision tower.
    pub vision: Option<VisionProgram>,
    /// EAGLE3 aux slots the stage's steps take in and pass on (`[S,
    /// hidden]` each, after `x`: the states made on earlier stages, then
    /// those too that it makes); 0 without a draft.
    pub aux_in: usize,
    pub aux_slots: usize,
    /// The EAGLE3 draft head's two entries, on the stage that runs it.
    pub draft: Option<DraftProgram>,
}

/// An EAGLE3 draft head's entries: both take the step's rows (ids, positions,
/// block tables) and leave the greedy draft ids in `out_ids`, the logits
/// (draft vocabulary) in `logits` and the pre-norm hidden state in `x`.
#[derive(Debug, Clone)]
pub struct DraftProgram {
    /// The draft vocabulary (its logits' width).
    pub vocab: usize,
    /// The carry slot of each aux state, in the order the draft's `fc` reads them.
    pub order: Vec<usize>,
    /// Width of the first entry's input rows: the aux states concatenated.
    pub aux_width: usize,
    /// From the target's aux states (`aux`, `[S, aux_width]`).
    pub first: Vec<Step>,
    /// From its own hidden state of the row before (`x`).
    pub next: Vec<Step>,
}

/// The stage's step entry: what it takes, what it gives and its steps.
#[derive(Debug, Clone)]
pub struct TextProgram {
    pub input: Boundary,
    pub output: Boundary,
    pub steps: Vec<Step>,
}

/// The stage's vision entry: what it takes and its steps.
#[derive(Debug, Clone)]
pub struct VisionProgram {
    /// Values per patch row (1176 for MiniMax-M3).
    pub patch_row: usize,
    /// Patch rows per image token (the 2×2 merge: 4).
    pub merge: usize,
    /// Every step, layer by layer (what the listing shows).
    pub steps: Vec<Step>,
    /// The encoder layers as one loop, when every layer's steps are layer
    /// 0's with its own weights (the entry then runs `steps[..start]`, the
    /// loop, and the steps after the last layer).
    pub layers: Option<LayerLoop>,
}

/// Encoder layers `0..count` at `steps[start..start + len·count]`, each
/// `len` steps that differ from layer 0's only in their weight slots (layer
/// l's are layer 0's + l·stride) and in which scratch buffers they use.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerLoop {
    pub start: usize,
    pub len: usize,
    pub count: usize,
    /// Layer 0's first weight slot and the slots of one layer.
    pub first_slot: usize,
    pub stride: usize,
}

/// `steps` with weight slots made relative to `first_slot` and buffers
/// numbered by first use (buffers from before the range keep their id), so
/// two layers compare equal when they run the same code.
fn normalized(steps: &[Step], first_slot: usize, outer: &BTreeSet<usize>) -> Option<Vec<Step>> {
    let mut ids: HashMap<usize, usize> = HashMap::new();
    let id = |i: usize, ids: &mut HashMap<usize, usize>| {
        if outer.contains(&i) {
            i
        } else {
            let n = ids.len();
            *ids.entry(i).or_insert(usize::MAX - n)
        }
    };
    let arg = |a: &Arg, ids: &mut HashMap<usize, usize>| -> Option<Arg> {
        Some(match a {
            Arg::Weight { slot, ty } => Arg::Weight { slot: slot.checked_sub(first_slot)?, ty: ty.clone() },
            Arg::Buf { id: i, width, elem } => Arg::Buf { id: id(*i, ids), width: *width, elem },
            other => other.clone(),
        })
    };
    steps
        .iter()
        .map(|s| {
            Some(match s {
                Step::Alloc { id: i, width, elem } => Step::Alloc { id: id(*i, &mut ids), width: *width, elem },
                Step::Free { id: i, width, elem } => Step::Free { id: id(*i, &mut ids), width: *width, elem },
                Step::Call { kernel, args, per_sequence, .. } => Step::Call {
                    kernel: kernel.clone(),
                    args: args.iter().map(|a| arg(a, &mut ids)).collect::<Option<_>>()?,
                    what: String::new(),
                    per_sequence: *per_sequence,
                },
                _ => return None,
            })
        })
        .collect()
}

impl VisionProgram {
    /// Finds the layer loop: layer l's steps start where its first weight
    /// is read; every layer must normalise to layer 0's.
    fn find_loop(steps: &[Step], starts: &[(usize, usize)], end: usize) -> Option<LayerLoop> {
        let count = starts.len();
        if count < 2 {
            return None;
        }
        let start = starts[0].0;
        let len = starts[1].0 - start;
        let stride = starts[1].1 - starts[0].1;
        if starts.iter().enumerate().any(|(l, &(s, w))| s != start + l * len || w != starts[0].1 + l * stride) || start + len * count != end
        {
            return None;
        }
        let outer: BTreeSet<usize> =
            steps[..start].iter().filter_map(|s| if let Step::Alloc { id, .. } = s { Some(*id) } else { None }).collect();
        let first = normalized(&steps[start..start + len], starts[0].1, &outer)?;
        for l in 1..count {
            let at = start + l * len;
            if normalized(&steps[at..at + len], starts[0].1 + l * stride, &outer)? != first {
                return None;
            }
        }
        Some(LayerLoop { start, len, count, first_slot: starts[0].1, stride })
    }
}

struct Fuser<'a> {
    cfg: &'a ModelConfig,
    graph: &'a ModelGraph,
    parts: &'a BTreeSet<Part>,
    specs: HashMap<String, TensorSpec>,
    tensors: Vec<TensorSlot>,
    caches: Vec<CacheSlot>,
    cache_slots: HashMap<(usize, CacheKind), usize>,
    /// How every cache of the stage stores its elements.
    cache: Storage,
    /// Positions per cache block.
    kv_block: usize,
    /// How activations between kernels are stored.
    act: Storage,
    steps: Vec<Step>,
    kernels: Vec<Kernel>,
    vals: HashMap<NodeIndex, Arg>,
    /// The expert ids a router node produced (its weights are in `vals`).
    router_ids: HashMap<NodeIndex, Arg>,
    next_buf: usize,
    live: Vec<(usize, usize, &'static str)>,
    /// Lowering a draft entry: the embedding gets a buffer of its own (`x`
    /// holds the draft's hidden state).
    in_draft: bool,
    /// The embedding takes image features that another stage encodes.
    images_from_elsewhere: bool,
}

fn weight_type(d: DType) -> Result<WeightType, String> {
    match d {
        DType::F32 => Ok(WeightType::F32),
        DType::BF16 => Ok(WeightType::BF16),
        DType::F16 => Ok(WeightType::F16),
        other => Err(format!("no kernel reads {other} weights")),
    }
}

fn width_of(shape: &[Dim]) -> usize {
    shape.iter().skip(1).map(|d| if let Dim::Fixed(n) = d { *n } else { 1 }).product()
}

impl Fuser<'_> {
    fn node(&self, n: NodeIndex) -> &Op {
        &self.graph.graph[n].op
    }

    fn in_stage(&self, n: NodeIndex) -> bool {
        self.parts.contains(&self.graph.graph[n].part)
    }

    fn consumers(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut c: Vec<NodeIndex> = self.graph.graph.neighbors_directed(n, Direction::Outgoing).collect();
        c.sort();
        c.dedup();
        c
    }

    /// The value of operand `n`: computed in this stage, or the stage input.
    /// Records that node `n`'s value lives in `v`.
    fn define(&mut self, n: NodeIndex, v: Arg) -> Result<(), String> {
        self.vals.insert(n, v);
        Ok(())
    }

    fn val(&self, n: NodeIndex) -> Result<Arg, String> {
        if let Some(v) = self.vals.get(&n) {
            return Ok(v.clone());
        }
        match self.node(n) {
            Op::TokenIds => Ok(Arg::Ids),
            Op::Positions => Ok(Arg::Pos),
            Op::PixelRows => Ok(Arg::Pixels { row: width_of(&self.graph.graph[n].ty.shape) }),
            Op::PatchPositions => Ok(Arg::PatchPos),
            Op::ImageSegments => Ok(Arg::Segments),
            Op::AuxRows => Ok(Arg::Aux { slot: None, width: width_of(&self.graph.graph[n].ty.shape) }),
            Op::DraftHidden => Ok(Arg::X),
            _ if !self.in_stage(n) => Ok(Arg::X),
            op => Err(format!("operand {} ({}) used before it is computed", n.index(), op.name())),
        }
    }

    fn weight(&mut self, name: &str) -> Result<(usize, DType, Vec<usize>), String> {
        let spec = self.specs.get(name).ok_or_else(|| format!("the graph names tensor `{name}`, which the layout lacks"))?;
        let (dtype, shape) = (spec.nominal, spec.shape.clone());
        let slot = self.tensors.len();
        self.tensors.push(TensorSlot { name: name.to_string(), shape: shape.clone(), dtype });
        Ok((slot, dtype, shape))
    }

    fn weight_arg(&mut self, name: &str, elem: &'static str) -> Result<Arg, String> {
        let (slot, _, shape) = self.weight(name)?;
        Ok(Arg::Weight { slot, ty: MemTy::fixed(&shape, elem) })
    }

    fn float_weight(&mut self, name: &str) -> Result<(Arg, WeightType), String> {
        let (slot, dtype, shape) = self.weight(name)?;
        let wt = weight_type(dtype)?;
        Ok((Arg::Weight { slot, ty: MemTy::fixed(&shape, wt.mlir_elem()) }, wt))
    }

    fn alloc(&mut self, width: usize, elem: &'static str) -> Arg {
        let id = self.next_buf;
        self.next_buf += 1;
        self.steps.push(Step::Alloc { id, width, elem });
        self.live.push((id, width, elem));
        Arg::Buf { id, width, elem }
    }

    fn call(&mut self, kernel: Kernel, args: Vec<Arg>, what: String) {
        // Attention and cache writes run per sequence; everything else over all rows.
        let per_sequence = args.iter().any(|a| matches!(a, Arg::Cache { .. }));
        self.push_call(kernel, args, what, per_sequence);
    }

    /// A call once per image (the vision entry's "sequences").
    fn call_per_image(&mut self, kernel: Kernel, args: Vec<Arg>, what: String) {
        self.push_call(kernel, args, what, true);
    }

    fn push_call(&mut self, kernel: Kernel, args: Vec<Arg>, what: String, per_sequence: bool) {
        if !self.kernels.contains(&kernel) {
            self.kernels.push(kernel.clone());
        }
        self.steps.push(Step::Call { kernel, args, what, per_sequence });
    }

    /// Every cache of the stage (K, V and MSA index keys) stores `--kv-cache`'s
    /// type: at long context the indexer's scan of index keys is the largest
    /// read of a decode step, so it gains the most from bf16.
    fn cache_slot(&mut self, layer: usize, kind: CacheKind, width: usize) -> (usize, Storage) {
        let cache = self.cache;
        let slot = *self.cache_slots.entry((layer, kind)).or_insert_with(|| {
            self.caches.push(CacheSlot { layer, kind: cache_kind_name(kind).into(), width, bytes: cache.bytes() });
            self.caches.len() - 1
        });
        (slot, cache)
    }

    /// A fresh buffer for node `n` (of `width` columns), and the cache slot
    /// its rows go to when its one consumer is a cache append.
    fn output_for(&mut self, n: NodeIndex, width: usize) -> (Arg, Option<(usize, Storage)>) {
        let cons = self.consumers(n);
        let buf = self.alloc(width, self.act.mlir_elem());
        if let [c] = cons.as_slice() {
            if let Op::CacheAppend { kind, layer, .. } = *self.node(*c) {
                let (slot, cache) = self.cache_slot(layer, kind, width);
                self.vals.insert(*c, Arg::Cache { slot, width, cache });
                return (buf, Some((slot, cache)));
            }
        }
        (buf, None)
    }

    /// After a producer of cached rows: each sequence's rows into its cache.
    /// (The producer itself runs once over every row of the micro-batch.)
    fn write_cache(&mut self, buf: &Arg, slot: Option<(usize, Storage)>, width: usize, what: &str) {
        if let Some((slot, cache)) = slot {
            self.call(
                Kernel::ScatterRows(m3c_kernels::ScatterRows { width, paged: Some(self.kv_block), cache, act: self.act }),
                vec![buf.clone(), Arg::Pos, Arg::BlockTable, Arg::Cache { slot, width, cache }],
                format!("{what} → cache"),
            );
        }
    }

    fn lower(&mut self, n: NodeIndex, what: String) -> Result<(), String> {
        let g = self.graph;
        let node = &g.graph[n];
        let ops = g.operands(n);
        let t = &self.cfg.text;
        let width = width_of(&node.ty.shape);
        match node.op.clone() {
            Op::TokenIds
            | Op::Positions
            | Op::PixelRows
            | Op::PatchPositions
            | Op::ImageSegments
            | Op::HeadRmsNorm { .. }
            | Op::IndexScores { .. }
            | Op::BlockMaxScore { .. }
            | Op::TopKBlocks { .. } => {}
            Op::CacheAppend { .. } => {
                if !self.vals.contains_key(&n) {
                    return Err(format!("{what}: cache append of a value not written into the cache"));
                }
            }
            Op::Embedding { weight } => {
                let (w, wt) = self.float_weight(&weight)?;
                let k = Kernel::Embedding(m3c_kernels::Embedding { vocab: t.vocab_size, width: t.hidden_size, weight: wt, act: self.act });
                let y = if self.in_draft { self.alloc(t.hidden_size, self.act.mlir_elem()) } else { Arg::X };
                self.call(k, vec![Arg::Ids, w, y.clone()], what);
                self.vals.insert(n, y);
            }
            Op::RmsNorm { weight, eps, gemma } => {
                let x = self.val(ops[0])?;
                let (w, wt) = self.float_weight(&weight)?;
                let y = self.alloc(width, self.act.mlir_elem());
                self.call(
                    Kernel::RmsNorm(m3c_kernels::RmsNorm { width, eps, weight: wt, act: self.act, gemma }),
                    vec![x, w, y.clone()],
                    what,
                );
                self.vals.insert(n, y);
            }
            Op::Linear { .. } => self.lower_linear(n, &node.op, what)?,
            Op::Rope { .. } => self.lower_rope(n, &node.op, what)?,
            Op::Attention { .. } => self.lower_attention(n, &node.op, what)?,
            Op::Add => {
                let (a, b) = (self.val(ops[0])?, self.val(ops[1])?);
                // In place when the first operand dies here (residual stream, routed sum).
                // (An aux tap reads the stream at the end of its producer's
                // part, before this add.)
                let a_dies = self.consumers(ops[0]).iter().all(|&c| c <= n || crate::graph::draft::is_tap(self.graph, c));
                let y = if a_dies { a.clone() } else { self.alloc(width, self.act.mlir_elem()) };
                self.call(Kernel::Add(m3c_kernels::Add { width, act: self.act }), vec![a, b, y.clone()], what);
                self.vals.insert(n, y);
            }
            Op::SwiGluOai { alpha, limit, beta } => {
                let (gt, up) = (self.val(ops[0])?, self.val(ops[1])?);
                let y = self.alloc(width, self.act.mlir_elem());
                self.call(
                    Kernel::SwiGluOai(m3c_kernels::SwiGluOai { width, alpha, limit, beta, act: self.act }),
                    vec![gt, up, y.clone()],
                    what,
                );
                self.vals.insert(n, y);
            }
            Op::LayerNorm { weight, bias, eps } => {
                let x = self.val(ops[0])?;
                let (w, wt) = self.float_weight(&weight)?;
                let (b, _) = self.float_weight(&bias)?;
                let y = self.alloc(width, self.act.mlir_elem());
                self.call(
                    Kernel::LayerNorm(m3c_kernels::LayerNorm { width, eps, weight: wt, act: self.act }),
                    vec![x, w, b, y.clone()],
                    what,
                );
                self.vals.insert(n, y);
            }
            Op::BiasAct { bias, gelu } => {
                // In place: a bias always follows the linear that made its operand.
                let x = self.val(ops[0])?;
                let (b, wt) = self.float_weight(&bias)?;
                self.call(
                    Kernel::BiasAct(m3c_kernels::BiasAct { width, weight: wt, gelu, act: self.act }),
                    vec![x.clone(), b, x.clone()],
                    what,
                );
                self.vals.insert(n, x);
            }
            Op::AxialRope { heads, head_dim, axis_dim, theta } => {
                let x = self.val(ops[0])?;
                let k = m3c_kernels::AxialRope { heads, head_dim, axis_dim, theta, act: self.act };
                self.call(Kernel::AxialRope(k), vec![x.clone(), Arg::PatchPos, x.clone()], what);
                self.vals.insert(n, x);
            }
            Op::ImageAttention { heads, head_dim, scale } => {
                // Causal attention whose every row's "position" is its image's
                // last row sees exactly its image: bidirectional, one segment each.
                let (q, k, v) = (self.val(ops[0])?, self.val(ops[1])?, self.val(ops[2])?);
                let o = self.alloc(heads * head_dim, self.act.mlir_elem());
                let att = m3c_kernels::Attention {
                    heads,
                    kv_heads: heads,
                    head_dim,
                    scale,
                    sparse: None,
                    paged: None,
                    cache: self.act,
                    act: self.act,
                };
                self.call_per_image(Kernel::Attention(att), vec![q, k, v, Arg::Segments, o.clone()], what);
                self.vals.insert(n, o);
            }
            Op::MergePatches { factor } => {
                let x = self.val(ops[0])?;
                let Arg::Buf { id, width: w, elem } = x else {
                    return Err(format!("{what}: merging patches of a value that is not a scratch buffer"));
                };
                let to = self.next_buf;
                self.next_buf += 1;
                self.steps.push(Step::Regroup { from: id, to, width: w, factor, elem });
                self.vals.insert(n, Arg::Buf { id: to, width: w * factor, elem });
            }
            Op::ImageScatter { .. } => {
                // Only where images come in (this stage's tower, or another
                // stage's features); `x` holds the embeddings.
                let x = self.val(ops[0])?;
                if self.parts.contains(&Part::Vision) || self.images_from_elsewhere {
                    let k = Kernel::ScatterRows(m3c_kernels::ScatterRows { width, paged: None, cache: self.act, act: self.act });
                    if !self.kernels.contains(&k) {
                        self.kernels.push(k.clone());
                    }
                    self.steps.push(Step::ImageRows { kernel: k, args: vec![Arg::Img, Arg::ImgRows, x.clone()], what });
                }
                self.vals.insert(n, x);
            }
            Op::AuxState { .. } | Op::Concat | Op::AuxRows | Op::DraftHidden => self.lower_eagle3(n, what)?,
            Op::Router { .. } => self.lower_router(n, &node.op, what)?,
            Op::RoutedExperts { .. } => self.lower_routed_experts(n, &node.op, what)?,
            Op::Sample => {
                let x = self.val(ops[0])?;
                let Arg::Logits { vocab } = x else {
                    return Err(format!("{what}: sampling from a value that is not the logits"));
                };
                let words = m3c_contract::sampling::seen_words(vocab);
                self.call(
                    Kernel::Sample(m3c_kernels::Sample { width: vocab }),
                    vec![x, Arg::Table, Arg::Seen { words }, Arg::Bias { vocab }, Arg::OutIds],
                    what,
                );
            }
        }
        Ok(())
    }
    /// What an EAGLE3 draft adds: an aux state copied into its carry slot,
    /// the head's concatenated input (two column copies), and its inputs
    /// (read where used: `val`).
    fn lower_eagle3(&mut self, n: NodeIndex, what: String) -> Result<(), String> {
        let g = self.graph;
        let ops = g.operands(n);
        let width = width_of(&g.graph[n].ty.shape);
        match g.graph[n].op {
            Op::AuxState { slot } => {
                let from = match self.val(ops[0])? {
                    Arg::X => None,
                    Arg::Buf { id, .. } => Some(id),
                    other => return Err(format!("{what}: an aux state in {other}, not the residual stream")),
                };
                self.steps.push(Step::CopyAux { from, slot, width });
            }
            Op::Concat => {
                let (a, b) = (self.val(ops[0])?, self.val(ops[1])?);
                let wa = width_of(&g.graph[ops[0]].ty.shape);
                let y = self.alloc(width, self.act.mlir_elem());
                for (x, w, offset) in [(a, wa, 0), (b, width - wa, wa)] {
                    let k = Kernel::CopyCols(m3c_kernels::CopyCols { width: w, into: width, offset, act: self.act });
                    self.call(k, vec![x, y.clone()], what.clone());
                }
                self.vals.insert(n, y);
            }
            Op::AuxRows | Op::DraftHidden => {}
            ref other => return Err(format!("{what}: {} is not an EAGLE3 op", other.name())),
        }
        Ok(())
    }

    /// A linear: logits (f32, for the sampler) or an activation, MXFP8 or float weights.
    fn lower_linear(&mut self, n: NodeIndex, op: &Op, what: String) -> Result<(), String> {
        let Op::Linear { weight, out, inp, mxfp8_block } = op.clone() else {
            return Err(format!("{what}: not a Linear node"));
        };
        let ops = self.graph.operands(n);
        let x = self.val(ops[0])?;
        // Logits stay f32 whatever the activations are: they are the
        // stage's result, and sampling compares them.
        let (y, cache, out_act) = if self.consumers(n).iter().any(|&c| matches!(self.node(c), Op::Sample)) {
            (Arg::Logits { vocab: out }, None, Storage::F32)
        } else {
            let (y, cache) = self.output_for(n, out);
            (y, cache, self.act)
        };
        let act = self.act;
        let (k, mut args) = match mxfp8_block {
            Some(block) => {
                let w = self.weight_arg(&weight, "i8")?;
                let s = self.weight_arg(&names::scales(names::without_weight(&weight)), "i8")?;
                (Kernel::Linear(m3c_kernels::Linear { inp, out, weight: WeightType::Mxfp8 { block }, act, out_act }), vec![x, w, s])
            }
            None => {
                let (slot, dtype, _) = self.weight(&weight)?;
                let wt = weight_type(dtype)?;
                // Viewed as [out, inp] whatever its stored rank: the patch
                // Conv3d's [out, c, t, y, x] is that matrix in C order.
                let w = Arg::Weight { slot, ty: MemTy::fixed(&[out, inp], wt.mlir_elem()) };
                // Pixels enter as f32 whatever the activations are (vision spec §7).
                let act = if matches!(x, Arg::Pixels { .. }) { Storage::F32 } else { act };
                (Kernel::Linear(m3c_kernels::Linear { inp, out, weight: wt, act, out_act }), vec![x, w])
            }
        };
        args.push(y.clone());
        self.call(k, args, what.clone());
        self.write_cache(&y, cache, out, &what);
        self.define(n, y)
    }

    /// Per-head norm + RoPE, fused (the norm is the RoPE's operand).
    fn lower_rope(&mut self, n: NodeIndex, op: &Op, what: String) -> Result<(), String> {
        let Op::Rope { heads, head_dim, rotary_dim, theta } = op.clone() else {
            return Err(format!("{what}: not a Rope node"));
        };
        let (g, ops) = (self.graph, self.graph.operands(n));
        let norm = ops[0];
        let Op::HeadRmsNorm { weight, eps, .. } = self.node(norm).clone() else {
            // RoPE on the projection itself (an EAGLE3 draft's q and k).
            let x = self.val(norm)?;
            let (y, cache) = self.output_for(n, heads * head_dim);
            let k = m3c_kernels::HeadNormRope {
                heads,
                head_dim,
                rotary_dim,
                theta,
                eps: 0.0,
                weight: WeightType::F32,
                act: self.act,
                norm: false,
            };
            self.call(Kernel::HeadNormRope(k), vec![x, Arg::Pos, y.clone()], what.clone());
            self.write_cache(&y, cache, heads * head_dim, &what);
            return self.define(n, y);
        };
        let x = self.val(g.operands(norm)[0])?;
        let (w, wt) = self.float_weight(&weight)?;
        let (y, cache) = self.output_for(n, heads * head_dim);
        let k = Kernel::HeadNormRope(m3c_kernels::HeadNormRope {
            heads,
            head_dim,
            rotary_dim,
            theta,
            eps,
            weight: wt,
            act: self.act,
            norm: true,
        });
        self.call(k, vec![x, w, Arg::Pos, y.clone()], what.clone());
        self.write_cache(&y, cache, heads * head_dim, &what);
        self.define(n, y)
    }

    /// Attention, with the MSA indexer (scores, block max, top-k) fused in.
    fn lower_attention(&mut self, n: NodeIndex, op: &Op, what: String) -> Result<(), String> {
        let Op::Attention { heads, kv_heads, head_dim, scale, sparse_block } = op.clone() else {
            return Err(format!("{what}: not a Attention node"));
        };
        let (g, ops) = (self.graph, self.graph.operands(n));
        let (q, kc, vc) = (self.val(ops[0])?, self.val(ops[1])?, self.val(ops[2])?);
        let mut args = vec![q, kc, vc, Arg::Pos, Arg::BlockTable];
        let sparse = match sparse_block {
            None => None,
            Some(block) => {
                let sel = ops[4];
                let Op::TopKBlocks { k, local, init, .. } = *self.node(sel) else {
                    return Err(format!("{what}: sparse attention without a top-k block selection"));
                };
                let bmax = g.operands(sel)[0];
                let scores = g.operands(bmax)[0];
                let Op::IndexScores { heads: ih, dim } = *self.node(scores) else {
                    return Err(format!("{what}: block selection without indexer scores"));
                };
                let so = g.operands(scores);
                args.push(self.val(so[0])?);
                args.push(self.val(so[1])?);
                Some(SparseSel { index_heads: ih, index_dim: dim, block, topk: k, local, init })
            }
        };
        let o = self.alloc(heads * head_dim, self.act.mlir_elem());
        args.push(o.clone());
        self.call(
            Kernel::Attention(m3c_kernels::Attention {
                heads,
                kv_heads,
                head_dim,
                scale,
                sparse,
                paged: Some(self.kv_block),
                cache: self.cache,
                act: self.act,
            }),
            args,
            what,
        );
        self.define(n, o)
    }

    /// The router: weights and ids, the pair every routed-experts call reads.
    fn lower_router(&mut self, n: NodeIndex, op: &Op, what: String) -> Result<(), String> {
        let Op::Router { weight, bias, experts, top_k, scale } = op.clone() else {
            return Err(format!("{what}: not a Router node"));
        };
        let (t, ops) = (&self.cfg.text, self.graph.operands(n));
        let h = self.val(ops[0])?;
        let (w, wt) = self.float_weight(&weight)?;
        let mut args = vec![h, w];
        let bt = match bias {
            Some(b) => {
                let (ba, bt) = self.float_weight(&b)?;
                args.push(ba);
                Some(bt)
            }
            None => None,
        };
        let wts = self.alloc(top_k, "f32");
        let ids = self.alloc(top_k, "i64");
        args.push(wts.clone());
        args.push(ids.clone());
        let k = Kernel::Router(m3c_kernels::Router { width: t.hidden_size, experts, top_k, scale, weight: wt, bias: bt, act: self.act });
        self.call(k, args, what);
        // The routing value is the pair; consumers read both.
        self.vals.insert(n, wts);
        self.router_ids.insert(n, ids);

        Ok(())
    }

    /// The routed experts, their tensors bound as one pointer table.
    fn lower_routed_experts(&mut self, n: NodeIndex, op: &Op, what: String) -> Result<(), String> {
        let Op::RoutedExperts { weights: stems, experts, hidden, intermediate, mxfp8_block, alpha, limit, beta, .. } = op.clone() else {
            return Err(format!("{what}: not a RoutedExperts node"));
        };
        let (t, ops) = (&self.cfg.text, self.graph.operands(n));
        let h = self.val(ops[0])?;
        let routing = ops[1];
        let wts = self.val(routing)?;
        let ids = self.router_ids.get(&routing).cloned().ok_or("routed experts without router ids")?;
        let top_k = t.moe.experts_per_token;
        let weight = match mxfp8_block {
            Some(block) => WeightType::Mxfp8 { block },
            None => {
                let first = names::weight(stems.first().map(|s| s[0].as_str()).ok_or("routed experts without experts")?);
                let d = self.specs.get(&first).map(|s| s.nominal).ok_or("no expert 0 in the layout")?;
                weight_type(d)?
            }
        };
        let first_slot = self.tensors.len();
        for x in stems.iter().flatten() {
            self.weight(&names::weight(x))?;
            if mxfp8_block.is_some() {
                self.weight(&names::scales(x))?;
            }
        }
        debug_assert_eq!(self.tensors.len() - first_slot, experts * expert_tensor_types(hidden, intermediate, weight).len());
        let y = self.alloc(hidden, self.act.mlir_elem());
        let k = Kernel::RoutedExperts(m3c_kernels::RoutedExperts {
            experts,
            hidden,
            inter: intermediate,
            top_k,
            weight,
            alpha,
            limit,
            beta,
            act: self.act,
        });
        self.call(k, vec![h, wts, ids, Arg::ExpertTable { first_slot }, y.clone()], what);
        self.define(n, y)
    }
}

/// What a stage compiles of an EAGLE3 draft: the aux slots every step
/// carries, and the head itself on the stage that runs it.
#[derive(Clone, Copy, Default)]
pub struct DraftPart<'d> {
    /// Aux slots the stage receives, and passes on (with its own).
    pub aux_in: usize,
    pub aux_slots: usize,
    pub head: Option<&'d crate::plan::draft::DraftHead>,
}

/// Fuses and schedules the nodes of `parts` (and, with `draft.head`, the
/// draft head's entries).
pub fn fuse_stage(
    cfg: &ModelConfig,
    graph: &ModelGraph,
    parts: &BTreeSet<Part>,
    storages: Storages,
    draft: DraftPart,
    images_from_elsewhere: bool,
) -> Result<FusedStage, String> {
    let mut specs: HashMap<String, TensorSpec> = expected_tensors(cfg).into_iter().map(|s| (s.name.clone(), s)).collect();
    let heads = draft.head.map(|d| (d, crate::graph::draft::draft_graph(cfg, d, true), crate::graph::draft::draft_graph(cfg, d, false)));
    if let Some((d, _, _)) = &heads {
        specs.extend(crate::graph::draft::tensors(d).into_iter().map(|s| (s.name.clone(), s)));
    }
    let draft_parts: BTreeSet<Part> = [Part::Draft].into();
    let mut f = Fuser {
        cfg,
        graph,
        parts,
        specs,
        tensors: Vec::new(),
        caches: Vec::new(),
        cache_slots: HashMap::new(),
        cache: storages.kv_cache,
        kv_block: cfg.text.kv_block(),
        act: storages.activations,
        steps: Vec::new(),
        kernels: Vec::new(),
        vals: HashMap::new(),
        router_ids: HashMap::new(),
        next_buf: 0,
        live: Vec::new(),
        in_draft: false,
        images_from_elsewhere,
    };
    let hidden = cfg.text.hidden_size;
    // Nodes in graph order (a topological order), grouped by part; the
    // vision tower is its own entry.
    let mut by_part: BTreeMap<Part, Vec<NodeIndex>> = BTreeMap::new();
    for n in graph.graph.node_indices() {
        let p = graph.graph[n].part;
        if parts.contains(&p) && p != Part::Vision {
            by_part.entry(p).or_default().push(n);
        }
    }
    for (part, nodes) in &by_part {
        for &n in nodes {
            let what = format!("{} {}{}", part_label(*part), graph.graph[n].op.name(), weight_label(&graph.graph[n].op));
            f.lower(n, what)?;
        }
        f.end_part(graph, *part)?;
    }
    let vision = match (parts.contains(&Part::Vision), cfg.vision.as_ref()) {
        (true, Some(v)) => Some(f.vision_program(graph, v)?),
        _ => None,
    };
    let (aux_in, aux_slots) = (draft.aux_in, draft.aux_slots);
    let draft = match &heads {
        Some((d, first, next)) => {
            f.parts = &draft_parts;
            f.in_draft = true;
            let aux_width = d.aux_layers.len() * d.target_hidden;
            let order = crate::graph::draft::carry_order(&d.aux_layers);
            Some(DraftProgram { vocab: d.draft_vocab, order, aux_width, first: f.draft_entry(first)?, next: f.draft_entry(next)? })
        }
        None => None,
    };
    let input = if parts.contains(&Part::Embedding) { Boundary::TokenIds } else { Boundary::Hidden { width: hidden } };
    // The stage's result: the value that a later stage (or nobody) reads.
    let output =
        if parts.contains(&Part::LmHead) { Boundary::Logits { vocab: cfg.text.vocab_size } } else { Boundary::Hidden { width: hidden } };
    Ok(FusedStage {
        hidden,
        act: storages.activations,
        tensors: f.tensors,
        caches: f.caches,
        kv_block: f.kv_block,
        kernels: f.kernels,
        text: TextProgram { input, output, steps: f.steps },
        vision,
        aux_in,
        aux_slots,
        draft,
    })
}

impl<'a> Fuser<'a> {
    /// One entry of the draft head: its nodes in graph order, the pre-norm
    /// hidden state (the last residual add) left in `x`, every buffer freed.
    fn draft_entry(&mut self, graph: &'a ModelGraph) -> Result<Vec<Step>, String> {
        let outer = std::mem::take(&mut self.steps);
        let outer_live = std::mem::take(&mut self.live);
        let (outer_graph, outer_vals) = (std::mem::replace(&mut self.graph, graph), std::mem::take(&mut self.vals));
        for n in graph.graph.node_indices() {
            let what = format!("draft {}{}", graph.graph[n].op.name(), weight_label(&graph.graph[n].op));
            self.lower(n, what)?;
        }
        let hidden = graph.graph.node_indices().rev().find(|&n| matches!(graph.graph[n].op, Op::Add));
        match hidden.and_then(|n| self.vals.get(&n).cloned()) {
            Some(Arg::X) => {}
            Some(Arg::Buf { id, width, .. }) => self.steps.push(Step::CopyToX { id, width }),
            other => return Err(format!("the draft head's hidden state is not a buffer: {other:?}")),
        }
        for (id, width, elem) in std::mem::take(&mut self.live) {
            self.steps.push(Step::Free { id, width, elem });
        }
        self.graph = outer_graph;
        self.vals = outer_vals;
        self.live = outer_live;
        Ok(std::mem::replace(&mut self.steps, outer))
    }

    /// The vision entry: every vision node in graph order, its result
    /// copied to `x` (`[P/4, hidden]`), every buffer freed.
    fn vision_program(&mut self, graph: &ModelGraph, v: &crate::config::VisionConfig) -> Result<VisionProgram, String> {
        // The stages take the image processor's rows; a tower of another
        // patch geometry would read them wrongly.
        use m3c_contract::images::{MERGE_SIDE as MERGE, PATCH, TEMPORAL};
        let geometry = (v.num_channels, v.temporal_patch_size, v.patch_size, v.spatial_merge_size);
        if geometry != (3, TEMPORAL, PATCH, MERGE) {
            return Err(format!(
                "{}: vision_config has {} channels, temporal patch {}, patch {} and spatial merge {}; m3c's image processor makes 3-channel rows of {TEMPORAL} frames of {PATCH}×{PATCH} patches in {MERGE}×{MERGE} merge groups (MiniMax-M3's)",
                self.cfg.source.display(),
                v.num_channels,
                v.temporal_patch_size,
                v.patch_size,
                v.spatial_merge_size
            ));
        }
        let family = self.cfg.family.model();
        let outer = std::mem::take(&mut self.steps);
        let outer_live = std::mem::take(&mut self.live);
        let nodes = graph.nodes_of(Part::Vision);
        let last = *nodes.last().ok_or("a vision config without vision nodes")?;
        // A merged view's buffer is its source's.
        let mut alias: HashMap<usize, usize> = HashMap::new();
        // (step index, first weight slot) where each encoder layer begins,
        // and where the steps after the last layer begin.
        let mut layer_starts: Vec<(usize, usize)> = Vec::new();
        let mut layers_end = None;
        for (i, &n) in nodes.iter().enumerate() {
            let what = format!("vision {}{}", graph.graph[n].op.name(), weight_label(&graph.graph[n].op));
            let (at, slot) = (self.steps.len(), self.tensors.len());
            self.lower(n, what)?;
            let read = self.tensors.get(slot).map(|t| t.name.clone());
            if let Some(l) = read.as_deref().and_then(|name| family.vision_layer_of(name)) {
                if l == layer_starts.len() {
                    layer_starts.push((at, slot));
                }
            } else if read.is_some() && !layer_starts.is_empty() && layers_end.is_none() {
                layers_end = Some(at);
            }
            if let Some(Step::Regroup { from, to, .. }) = self.steps.last() {
                alias.insert(*to, *from);
            }
            // A buffer no later node reads is freed now: 32 layers' worth of
            // [patches, width] buffers would not fit.
            let base = |v: Option<&Arg>| match v {
                Some(Arg::Buf { id, .. }) => Some(*alias.get(id).unwrap_or(id)),
                _ => None,
            };
            let mut needed: BTreeSet<usize> =
                nodes[i + 1..].iter().flat_map(|&m| graph.operands(m)).filter_map(|o| base(self.vals.get(&o))).collect();
            needed.extend(base(self.vals.get(&last)));
            needed.extend(base(self.vals.get(&n)));
            let (keep, free): (Vec<_>, Vec<_>) = std::mem::take(&mut self.live).into_iter().partition(|(id, _, _)| needed.contains(id));
            for (id, width, elem) in free {
                self.steps.push(Step::Free { id, width, elem });
            }
            self.live = keep;
        }
        match self.vals.get(&last) {
            Some(Arg::Buf { id, width, .. }) => {
                let (id, width) = (*id, *width);
                self.steps.push(Step::CopyToX { id, width })
            }
            other => return Err(format!("the vision tower's result is not a scratch buffer: {other:?}")),
        }
        for (id, width, elem) in std::mem::take(&mut self.live) {
            self.steps.push(Step::Free { id, width, elem });
        }
        let steps = std::mem::replace(&mut self.steps, outer);
        self.live = outer_live;
        let layers = layers_end.and_then(|end| VisionProgram::find_loop(&steps, &layer_starts, end));
        Ok(VisionProgram {
            patch_row: v.num_channels * v.temporal_patch_size * v.patch_size * v.patch_size,
            merge: v.spatial_merge_size * v.spatial_merge_size,
            steps,
            layers,
        })
    }

    /// At the end of `part`: a value read by a later stage must be in `x`
    /// (copied there unless computed in place); a value read by a later part
    /// of this stage stays alive; every other buffer of the part is freed.
    fn end_part(&mut self, graph: &ModelGraph, part: Part) -> Result<(), String> {
        let parts = self.parts;
        let mut keep = BTreeSet::new();
        let mut leaving: Vec<NodeIndex> = Vec::new();
        for (&n, v) in &self.vals {
            if graph.graph[n].part != part {
                continue;
            }
            for c in graph.graph.neighbors_directed(n, Direction::Outgoing) {
                let cp = graph.graph[c].part;
                if !parts.contains(&cp) {
                    leaving.push(n);
                } else if cp != part {
                    if let Arg::Buf { id, .. } = v {
                        keep.insert(*id);
                    }
                }
            }
        }
        leaving.sort();
        leaving.dedup();
        for n in leaving {
            match self.vals[&n].clone() {
                Arg::X => {}
                Arg::Buf { id, width, elem } if width == self.cfg.text.hidden_size && elem == self.act.mlir_elem() => {
                    self.steps.push(Step::CopyToX { id, width });
                    self.vals.insert(n, Arg::X);
                }
                other => return Err(format!("value {other} leaves the stage but is not the hidden state")),
            }
        }
        let (stay, free): (Vec<_>, Vec<_>) = std::mem::take(&mut self.live).into_iter().partition(|(id, _, _)| keep.contains(id));
        for (id, width, elem) in free {
            self.steps.push(Step::Free { id, width, elem });
        }
        self.live = stay;
        Ok(())
    }
}

/// ` q_proj`, ` input_layernorm`, ...: which weight an op reads, for listings.
fn weight_label(op: &Op) -> String {
    let w = match op {
        Op::Linear { weight, .. }
        | Op::RmsNorm { weight, .. }
        | Op::LayerNorm { weight, .. }
        | Op::Embedding { weight }
        | Op::Router { weight, .. }
        | Op::BiasAct { bias: weight, .. } => weight.as_str(),
        Op::Rope { .. } => return String::new(),
        Op::RoutedExperts { stem, .. } => stem.as_str(),
        _ => return String::new(),
    };
    let w = names::without_weight(w);
    let short = match w.find(".layers.") {
        Some(i) => w[i + 8..].split_once('.').map_or(w, |(_, rest)| rest),
        None => w.rsplit_once("model.").map_or(w, |(_, r)| r),
    };
    format!(" {short}")
}

pub fn part_label(p: Part) -> String {
    match p {
        Part::Embedding => "embed".into(),
        Part::Layer(l) => format!("layer {l}"),
        Part::FinalNorm => "final norm".into(),
        Part::LmHead => "lm_head".into(),
        Part::Vision => "vision".into(),
        Part::Draft => "draft".into(),
    }
}
