//! What `m3c compile` tells a stage executable about itself, and the C ABI
//! between the generated code and the runtime. The compiler writes
//! [`StageMeta`] as JSON into the executable (the `m3c_stage_meta` symbol);
//! the runtime reads it back with the same type.

use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// One weight slot of the stage's pointer table, in slot order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlot {
    /// The hub name the runtime binds.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// One per-layer cache (key, value or MSA index key) of each sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheSlot {
    pub layer: usize,
    /// `key`, `value` or `index_key`.
    pub kind: String,
    /// Elements per row.
    pub width: usize,
    /// Bytes per element: 4 (f32) or 2 (bf16).
    pub bytes: usize,
}

/// What flows into or out of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Boundary {
    /// Token ids `[S]` (the first stage's input).
    TokenIds,
    /// Rows `[S, width]` of activations between stages, f32 or bf16 bits (`--activations`).
    Hidden { width: usize },
    /// f32 logits `[S, vocab]` and the sampled ids (the last stage's output).
    Logits { vocab: usize },
}

/// Everything a stage executable knows about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageMeta {
    /// Hash of every compile input; all ranks of a job must agree on it.
    pub compile_id: String,
    /// sha256 of the config.json the stages were compiled from.
    pub config_sha256: String,
    pub stage: usize,
    pub stages: usize,
    pub hidden: usize,
    /// Bytes per stored activation: 4 (f32) or 2 (bf16 bits).
    pub act_bytes: usize,
    pub vocab: usize,
    /// `max_position_embeddings` of the config: the longest sequence.
    pub max_positions: usize,
    /// Positions per cache block: every cache slot is a pool of blocks of
    /// this many rows, and each sequence's block table names its blocks.
    pub kv_block: usize,
    /// What the stage holds, e.g. `embed + layers 0-3`.
    pub holds: String,
    pub first_stage: bool,
    pub last_stage: bool,
    /// LLVM CPU of the host code.
    pub cpu: String,
    /// The x86-64 features that host code may use, checked when the stage
    /// starts (`crate::cpu`; empty: not checked).
    #[serde(default)]
    pub cpu_features: Vec<String>,
    pub target: crate::target::Target,
    /// The plan's CUDA device ordinal for this stage, if it names one.
    pub device: Option<i32>,
    pub tensors: Vec<TensorSlot>,
    pub caches: Vec<CacheSlot>,
    /// Set on the stage that encodes images (the embedding's, with the vision tower).
    pub vision: Option<VisionMeta>,
    /// EAGLE3 aux slots after a step's `x` rows (`[S, hidden]` each, in
    /// activation storage): those it receives (made on earlier stages),
    /// and those its steps hold and pass on (with the ones it makes); 0
    /// without a draft head.
    pub aux_in: usize,
    pub aux_slots: usize,
    /// Set on the stage that runs the EAGLE3 draft head (the last).
    pub draft: Option<DraftMeta>,
    /// Encoder ranks of the job (a plan's `vision: {ranks: N}`): ranks
    /// `stages..stages + encoders`, after the stages.
    #[serde(default)]
    pub encoders: usize,
    /// This is the encoder ranks' program (the vision tower alone), not a
    /// stage's; `stage` is then the first encoder rank.
    #[serde(default)]
    pub encoder: bool,
}

/// What the stage that runs an EAGLE3 draft head knows of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftMeta {
    /// The draft vocabulary (its logits' width; `d2t` maps it to the target's).
    pub vocab: usize,
    /// The carry slot of each aux state, in the order its `fc` reads them.
    pub order: Vec<usize>,
    /// sha256 of the draft's config.json the head was compiled from.
    pub config_sha256: String,
}

/// What the stage that encodes images knows about them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VisionMeta {
    /// Values per patch row (3 · 2 · 14 · 14 = 1176 for MiniMax-M3).
    pub patch_row: usize,
    /// Patch rows per image token (the 2×2 merge: 4).
    pub merge: usize,
    /// The placeholder id whose embedding rows image features replace.
    pub image_token: i64,
    /// The video placeholder: video features replace its rows the same way.
    pub video_token: i64,
    /// The stage that holds the tower and encodes: this one, or (on the
    /// embedding's stage of a plan that puts the tower elsewhere) the one
    /// that sends the features here.
    pub encoder_stage: usize,
}

impl VisionMeta {
    /// Whether `id` is a placeholder whose row the vision tower's features
    /// replace (an image's or a video's: one list of features, in prompt
    /// order, fills both).
    pub fn is_placeholder(&self, id: i64) -> bool {
        id == self.image_token || id == self.video_token
    }
}

impl StageMeta {
    /// f32 words per row of `x` (the activations a stage takes and passes
    /// on): `x` moves as f32 words whatever it holds, so bf16 rows (an even
    /// hidden size, checked at compile time) take half as many.
    pub fn x_words(&self) -> usize {
        self.hidden * self.act_bytes / 4
    }

    /// f32 words per row of what a step carries between stages: `x` and,
    /// with an EAGLE3 draft, its aux slots (`x` for all rows, then each
    /// slot for all rows).
    pub fn carry_words(&self) -> usize {
        self.x_words() * (1 + self.aux_slots)
    }

    /// f32 words per row of what a step receives from the stage before:
    /// `x` and the aux slots made before this stage.
    pub fn carry_in_words(&self) -> usize {
        self.x_words() * (1 + self.aux_in)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn parse(bytes: &[u8]) -> Result<StageMeta, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("embedded stage metadata is unreadable ({e}): the executable is damaged"))
    }
}

/// The C ABI between a stage's generated code and the runtime.
pub mod abi {
    /// The generated step function takes one pointer, to a [`StepArgs`]:
    ///
    /// ```c
    /// void m3c_stage_step(const StepArgs *args);
    /// ```
    ///
    /// [`STEP_FIELDS`] is the one list of its fields: the struct below
    /// follows it (a test checks every offset), and the compiler writes the
    /// entry's loads from it, field `k` at byte `8k`.
    pub const ENTRY: &str = "m3c_stage_step";
    /// The generated vision entry (a no-op on stages without the tower),
    /// `void m3c_stage_vision(...)` over the positional parameters
    /// [`VISION_PARAMS`] lists: the compiler writes its signature from the
    /// list, and the runtime calls it from a [`VisionArgs`], which follows
    /// the list (a test checks every offset).
    pub const VISION: &str = "m3c_stage_vision";
    /// The vision entry's parameters, in order, each one 8-byte word. On a
    /// GPU stage `pixels`, `ppos`, `segs` and `out` are device memory.
    pub const VISION_PARAMS: &[(&str, Word)] = &[
        ("weights", Word::Ptr),     // void *const *: as the step's
        ("weights_dev", Word::Ptr), // as the step's
        ("images", Word::I64),      // images encoded together
        ("rows", Word::Ptr),        // const int64_t [images]: patch rows of each (a multiple of 4)
        ("patches", Word::I64),     // P = Σ rows
        ("pixels", Word::Ptr),      // const float [P, patch_row]: normalised patch rows
        ("ppos", Word::Ptr),        // const int64_t [P, 3]: (t, h, w) of each patch row
        ("segs", Word::Ptr),        // const int64_t [P]: each row's last row index within its image
        ("out", Word::Ptr),         // [P/4, hidden]: merged image features (activation storage)
    ];

    /// The vision entry's arguments, as [`VISION_PARAMS`] lists them.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub struct VisionArgs {
        pub weights: *const *const u8,
        pub weights_dev: *const *const u8,
        pub images: i64,
        pub rows: *const i64,
        pub patches: i64,
        pub pixels: *const f32,
        pub ppos: *const i64,
        pub segs: *const i64,
        pub out: *mut f32,
    }
    /// The EAGLE3 draft head's entries (no-ops on stages without one), each
    /// `void (const StepArgs *)`: the first over the target's aux states
    /// (`aux`, `[S, slots·hidden]`), the next over its own hidden states
    /// (`x`); both write `x`, `logits`, `out_ids` (greedy, `table` rows).
    pub const DRAFT_FIRST: &str = "m3c_draft_first";
    pub const DRAFT_NEXT: &str = "m3c_draft_next";
    /// The embedded metadata (`StageMeta` as JSON) and its length.
    pub const META: &str = "m3c_stage_meta";
    pub const META_LEN: &str = "m3c_stage_meta_len";
    /// Scratch buffers the generated code takes from the runtime: host
    /// memory, or a device pool on a GPU stage.
    pub const BUF_ALLOC: &str = "m3c_buf_alloc"; // void *(int64_t bytes)
    pub const BUF_FREE: &str = "m3c_buf_free"; // void (void *)
    pub const BUF_COPY: &str = "m3c_buf_copy"; // void (void *dst, void *src, int64_t bytes)
    /// The tensor-core GEMM hooks of CUDA stages.
    pub const GEMM_WANTED: &str = "m3c_gemm_wanted"; // int32_t (int64_t rows)
    pub const GEMM_BF16: &str = "m3c_gemm_bf16"; // void (x, w, y, rows, inp, out, y_bf16)
    /// The host target's sampler (`sampling::sample_row` over every row):
    /// void (logits, table, seen, bias, ids, rows, vocab, seen rows, seen
    /// words, bias rows).
    pub const SAMPLE_ROWS: &str = "m3c_sample_rows";

    /// What one word of [`StepArgs`] holds.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Word {
        Ptr,
        I64,
    }

    /// The layout version the generated code and the runtime agree on;
    /// the entry traps on any other (a stage linked against another
    /// runtime).
    pub const STEP_VERSION: i64 = 3;

    /// The fields of [`StepArgs`], in order, each one 8-byte word. On a GPU
    /// stage every array but `rows`, `caps` and the pointer tables is device
    /// memory.
    pub const STEP_FIELDS: &[(&str, Word)] = &[
        ("version", Word::I64),     // STEP_VERSION
        ("weights", Word::Ptr),     // void *const *: one pointer per StageMeta::tensors slot
        ("weights_dev", Word::Ptr), // the same table where kernels can read it (GPU); = weights on the host
        ("caches", Word::Ptr),      // void *const *: one pointer per cache slot, its pool [pool_rows, width]
        ("pool_rows", Word::I64),   // rows of every pool: blocks × kv_block
        ("blocks", Word::Ptr),      // const int64_t *const *: per sequence, its block table [caps / kv_block]
        ("sequences", Word::I64),   // sequences in the micro-batch
        ("rows", Word::Ptr),        // const int64_t [sequences]: rows of each
        ("caps", Word::Ptr),        // const int64_t [sequences]: positions each may reach (a multiple of kv_block)
        ("tokens", Word::I64),      // S = Σ rows
        ("ids", Word::Ptr),         // const int64_t [S]: token ids (first stage)
        ("x", Word::Ptr),           // [S, hidden] activations: in (unless first) and out (unless last)
        ("logits", Word::Ptr),      // float [S, vocab] (last stage)
        ("out_ids", Word::Ptr),     // int64_t [S]: sampled ids (last stage)
        ("table", Word::Ptr),       // int64_t [S, ROW_WORDS]: the sampling table (last stage; sampling::row)
        ("seen", Word::Ptr),        // const int32_t [bitmap_rows, ⌈vocab/32⌉]: seen-id and allowed-token bitmaps
        ("bitmap_rows", Word::I64), // BITMAP_ROWS per drawing slot: per segment, or per row of a verify segment
        ("bias", Word::Ptr),        // const float [bias_rows, vocab]: bias rows added to the logits (last stage)
        ("bias_rows", Word::I64),
        ("pos", Word::Ptr),      // const int64_t [S]: the position of each row
        ("nimg", Word::I64),     // K: rows of this step that are image placeholders (vision stage)
        ("img", Word::Ptr),      // [K, hidden]: their image features (activation storage)
        ("img_rows", Word::Ptr), // const int64_t [K]: the row of x each replaces
        ("aux", Word::Ptr), // EAGLE3 aux states: [slots, S, hidden] written by steps; [S, slots·hidden] read by the draft's first entry
    ];

    /// The step's arguments, as [`STEP_FIELDS`] lists them.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub struct StepArgs {
        pub version: i64,
        pub weights: *const *const u8,
        pub weights_dev: *const *const u8,
        pub caches: *const *mut f32,
        pub pool_rows: i64,
        pub blocks: *const *const i64,
        pub sequences: i64,
        pub rows: *const i64,
        pub caps: *const i64,
        pub tokens: i64,
        pub ids: *const i64,
        pub x: *mut f32,
        pub logits: *mut f32,
        pub out_ids: *mut i64,
        pub table: *mut i64,
        pub seen: *const u32,
        pub bitmap_rows: i64,
        pub bias: *const f32,
        pub bias_rows: i64,
        pub pos: *const i64,
        pub nimg: i64,
        pub img: *const f32,
        pub img_rows: *const i64,
        pub aux: *mut f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_args_are_laid_out_as_their_field_list_says() {
        use abi::{StepArgs, Word, STEP_FIELDS};
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<StepArgs>(), STEP_FIELDS.len() * 8);
        let offsets = [
            ("version", offset_of!(StepArgs, version)),
            ("weights", offset_of!(StepArgs, weights)),
            ("weights_dev", offset_of!(StepArgs, weights_dev)),
            ("caches", offset_of!(StepArgs, caches)),
            ("pool_rows", offset_of!(StepArgs, pool_rows)),
            ("blocks", offset_of!(StepArgs, blocks)),
            ("sequences", offset_of!(StepArgs, sequences)),
            ("rows", offset_of!(StepArgs, rows)),
            ("caps", offset_of!(StepArgs, caps)),
            ("tokens", offset_of!(StepArgs, tokens)),
            ("ids", offset_of!(StepArgs, ids)),
            ("x", offset_of!(StepArgs, x)),
            ("logits", offset_of!(StepArgs, logits)),
            ("out_ids", offset_of!(StepArgs, out_ids)),
            ("table", offset_of!(StepArgs, table)),
            ("seen", offset_of!(StepArgs, seen)),
            ("bitmap_rows", offset_of!(StepArgs, bitmap_rows)),
            ("bias", offset_of!(StepArgs, bias)),
            ("bias_rows", offset_of!(StepArgs, bias_rows)),
            ("pos", offset_of!(StepArgs, pos)),
            ("nimg", offset_of!(StepArgs, nimg)),
            ("img", offset_of!(StepArgs, img)),
            ("img_rows", offset_of!(StepArgs, img_rows)),
            ("aux", offset_of!(StepArgs, aux)),
        ];
        assert_eq!(offsets.len(), STEP_FIELDS.len(), "a field of the list without its offset here");
        for (k, (&(field, off), (name, _))) in offsets.iter().zip(STEP_FIELDS).enumerate() {
            assert_eq!((field, off), (*name, 8 * k), "field {k} of the list is `{name}`");
        }
        // The two kinds of word are both 8 bytes on the targets m3c runs on.
        assert_eq!((size_of::<*const u8>(), size_of::<i64>()), (8, 8));
        assert!(STEP_FIELDS.iter().filter(|(_, w)| *w == Word::I64).count() == 7);
    }

    #[test]
    fn vision_args_are_laid_out_as_their_parameter_list_says() {
        use abi::{VisionArgs, Word, VISION_PARAMS};
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<VisionArgs>(), VISION_PARAMS.len() * 8);
        let offsets = [
            ("weights", offset_of!(VisionArgs, weights)),
            ("weights_dev", offset_of!(VisionArgs, weights_dev)),
            ("images", offset_of!(VisionArgs, images)),
            ("rows", offset_of!(VisionArgs, rows)),
            ("patches", offset_of!(VisionArgs, patches)),
            ("pixels", offset_of!(VisionArgs, pixels)),
            ("ppos", offset_of!(VisionArgs, ppos)),
            ("segs", offset_of!(VisionArgs, segs)),
            ("out", offset_of!(VisionArgs, out)),
        ];
        assert_eq!(offsets.len(), VISION_PARAMS.len(), "a parameter of the list without its offset here");
        for (k, (&(field, off), (name, _))) in offsets.iter().zip(VISION_PARAMS).enumerate() {
            assert_eq!((field, off), (*name, 8 * k), "parameter {k} of the list is `{name}`");
        }
        assert_eq!(VISION_PARAMS.iter().filter(|(_, w)| *w == Word::I64).count(), 2);
    }

    #[test]
    fn metadata_round_trips_and_damage_is_named() {
        let m = StageMeta {
            compile_id: "c".into(),
            config_sha256: "s".into(),
            stage: 1,
            stages: 2,
            hidden: 8,
            act_bytes: 2,
            vocab: 16,
            max_positions: 64,
            kv_block: 4,
            holds: "layers 1-2".into(),
            first_stage: false,
            last_stage: true,
            cpu: "x86-64".into(),
            cpu_features: Vec::new(),
            target: crate::target::Target::Host,
            device: None,
            tensors: vec![TensorSlot { name: "w".into(), shape: vec![2, 8], dtype: DType::BF16 }],
            caches: vec![CacheSlot { layer: 1, kind: "key".into(), width: 8, bytes: 4 }],
            vision: Some(VisionMeta { patch_row: 1176, merge: 4, image_token: 200025, video_token: 200026, encoder_stage: 0 }),
            aux_in: 1,
            aux_slots: 3,
            encoders: 0,
            encoder: false,
            draft: Some(DraftMeta { vocab: 8, order: vec![2, 0, 1], config_sha256: "d".into() }),
        };
        assert_eq!(StageMeta::parse(m.to_json().as_bytes()).unwrap(), m);
        assert_eq!((m.x_words(), m.carry_in_words(), m.carry_words()), (4, 8, 16));
        assert!(StageMeta::parse(b"{").unwrap_err().contains("damaged"));
    }
}
