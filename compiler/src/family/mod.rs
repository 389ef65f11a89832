//! Model families: the one seam where a model plugs into the compiler.
//!
//! Everything after this seam is family-blind. The planner, the fusion pass,
//! the kernels, lowering, linking and the runtime see a [`ModelConfig`], a
//! tensor layout ([`TensorSpec`]s) and a [`ModelGraph`] of shared [`Op`]s;
//! none of them asks which model it is compiling. A family supplies those
//! three things from its `config.json`, plus the tiny random checkpoint the
//! tests and the demo are built on.
//!
//! Adding a family (docs/ARCHITECTURE.md, "Adding a model family"): a module
//! under `family/` implementing [`ModelFamily`], its `mod` line and its entry
//! in [`FAMILIES`]; its chat markers are a `ChatFormat` in
//! `contract/src/chat_format/`. A family that needs an operation the shared
//! vocabulary lacks adds an [`Op`] and its kernel, as any new kernel does; it
//! never adds a branch on the family to shared code.
//!
//! [`Op`]: crate::graph::Op

mod minimax_m3;
mod read;
mod rng;
mod tiny_spec;

pub use crate::config::Family;
pub use read::{load_config, parse_config};
pub use rng::Rng;
pub use tiny_spec::{TinySpec, TinyVision, HEAD_DIM};

use crate::config::{ConfigError, ModelConfig, Obj};
use crate::graph::ModelGraph;
use crate::model::TensorSpec;

/// What a model family provides to the compiler.
pub trait ModelFamily: Sync {
    /// The family's id, as `m3c init-tiny --family` and build caches name it
    /// (`minimax_m3`).
    fn id(&self) -> &'static str;

    /// The family's name in messages (`MiniMax-M3`).
    fn name(&self) -> &'static str;

    /// The `architectures` values of the `config.json` files it compiles.
    fn architectures(&self) -> &'static [&'static str];

    /// Reads and validates a `config.json` whose `architectures` is
    /// `architecture` (one of [`ModelFamily::architectures`]). Every
    /// assumption the graph makes is checked here, naming the key.
    fn parse_config(&self, root: &Obj, architecture: &str) -> Result<ModelConfig, ConfigError>;

    /// Every tensor the checkpoint of `cfg` must contain, by hub name, in a
    /// stable order: weight binding, `m3c inspect`, the cost model and the
    /// tiny generator all read this one list.
    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec>;

    /// The forward pass as a graph of shared operations, nodes in execution
    /// order, each tagged with the part (embedding, layer, head) it belongs
    /// to, so that any split of the parts into stages is a valid plan.
    fn graph(&self, cfg: &ModelConfig) -> ModelGraph;

    /// The hub name of the token embedding (an EAGLE3 head that shares
    /// its target's reads it there).
    fn embedding(&self, cfg: &ModelConfig) -> String;

    /// The prefix under which a checkpoint stores the tensors of `cfg` when
    /// the names of [`ModelFamily::tensors`] are absent from it (`has` says
    /// whether a name is present): a flat text config beside the hub's
    /// vision-language shards, for one.
    fn stored_prefix(&self, _cfg: &ModelConfig, _has: &dyn Fn(&str) -> bool) -> &'static str {
        ""
    }

    /// The vision-encoder layer a tensor belongs to, if any: the lowering
    /// runs the tower layer by layer and needs to know where each begins.
    fn vision_layer_of(&self, _name: &str) -> Option<usize> {
        None
    }

    /// The `config.json` of a tiny random model of this family.
    fn tiny_config(&self, spec: &TinySpec) -> serde_json::Value;

    /// Random values for one tensor of the tiny model: scaled so that every
    /// path of the model (clamps, routing, block selection) is exercised.
    fn tiny_values(&self, rng: &mut Rng, spec: &TensorSpec) -> Vec<f32>;

    /// The tokenizer files written beside a tiny checkpoint (name, bytes),
    /// so that it takes prompts and chats like a real one.
    fn tiny_tokenizer(&self) -> &'static [(&'static str, &'static [u8])];
}

/// Every family m3c compiles; the first is the default of `init-tiny`.
const FAMILIES: &[&dyn ModelFamily] = &[&minimax_m3::MiniMaxM3];

impl Family {
    /// Every family, in registry order.
    pub fn all() -> impl Iterator<Item = Family> {
        FAMILIES.iter().map(|f| Family(f.id()))
    }

    /// The family `id` names (`minimax_m3`), if m3c has it.
    pub fn of_id(id: &str) -> Option<Family> {
        Family::all().find(|f| f.0 == id)
    }

    /// The family's id.
    pub fn id(self) -> &'static str {
        self.0
    }

    /// The family's implementation.
    pub fn model(self) -> &'static dyn ModelFamily {
        // A `Family` is only made from `FAMILIES` (its field is the
        // registry's id), so the search cannot miss.
        FAMILIES.iter().copied().find(|f| f.id() == self.0).unwrap_or(FAMILIES[0])
    }

    /// The family whose `architectures` include `architecture`.
    pub fn of_architecture(architecture: &str) -> Option<Family> {
        Family::all().find(|f| f.model().architectures().contains(&architecture))
    }

    /// Every architecture m3c compiles, for messages.
    pub fn all_architectures() -> Vec<&'static str> {
        Family::all().flat_map(|f| f.model().architectures().iter().copied()).collect()
    }
}

impl Default for Family {
    fn default() -> Family {
        Family(FAMILIES[0].id())
    }
}
