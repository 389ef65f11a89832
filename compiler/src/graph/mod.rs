//! The model as a graph of typed operations (petgraph), built from the config
//! alone. Nodes are created in execution order, so node indices are a
//! topological order; every node records the model [`Part`] it belongs to,
//! which is how a stage takes its slice of the graph.

pub(crate) mod build;
pub mod draft;
mod dump;
mod ops;

pub use build::build_graph;
pub use ops::{CacheKind, Dim, Elem, Node, Op, TensorType};

use crate::model::Part;
use petgraph::graph::{DiGraph, NodeIndex};

/// Edge weight: the operand position at the consumer.
pub type Operand = usize;

pub struct ModelGraph {
    pub graph: DiGraph<Node, Operand>,
    /// The node that produces the logits.
    pub logits: NodeIndex,
}

impl ModelGraph {
    /// Operands of `n`, in operand order.
    pub fn operands(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut ins: Vec<(Operand, NodeIndex)> = self
            .graph
            .edges_directed(n, petgraph::Direction::Incoming)
            .map(|e| (*e.weight(), petgraph::visit::EdgeRef::source(&e)))
            .collect();
        ins.sort();
        ins.into_iter().map(|(_, s)| s).collect()
    }

    /// Nodes of one part, in execution order.
    pub fn nodes_of(&self, part: Part) -> Vec<NodeIndex> {
        self.graph.node_indices().filter(|&n| self.graph[n].part == part).collect()
    }

    pub fn text(&self) -> String {
        dump::dump(self)
    }

    /// [`ModelGraph::text`] restricted to `parts`.
    pub fn text_of(&self, parts: &std::collections::BTreeSet<Part>) -> String {
        dump::dump_where(self, |p| parts.contains(&p))
    }
}
