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
//! under `family/` implementing [`ModelFamily`], one [`Family`] variant, and
//! one line in [`Family::model`]. A family that needs an operation the shared
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

    /// The `config.json` of a tiny random model of this family.
    fn tiny_config(&self, spec: &TinySpec) -> serde_json::Value;

    /// Random values for one tensor of the tiny model: scaled so that every
    /// path of the model (clamps, routing, block selection) is exercised.
    fn tiny_values(&self, rng: &mut Rng, spec: &TensorSpec) -> Vec<f32>;
}

impl Family {
    pub const ALL: [Family; 1] = [Family::MiniMaxM3];

    /// The family's implementation.
    pub fn model(self) -> &'static dyn ModelFamily {
        match self {
            Family::MiniMaxM3 => &minimax_m3::MiniMaxM3,
        }
    }

    /// The family whose `architectures` include `architecture`.
    pub fn of_architecture(architecture: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model().architectures().contains(&architecture))
    }

    /// Every architecture m3c compiles, for messages.
    pub fn all_architectures() -> Vec<&'static str> {
        Family::ALL.iter().flat_map(|f| f.model().architectures().iter().copied()).collect()
    }
}
