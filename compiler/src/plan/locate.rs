//! Line and column of every node of a YAML document, by key path
//! (`stages[1].layers`), so that semantic errors in a plan point at the text.

use std::collections::HashMap;
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    pub line: usize,
    pub col: usize,
}

#[derive(Default)]
pub struct Locations {
    values: HashMap<String, Pos>,
    keys: HashMap<String, Pos>,
}

impl Locations {
    /// Where the value at `path` starts.
    pub fn value(&self, path: &str) -> Option<Pos> {
        self.values.get(path).copied()
    }
    /// Where the key of `path` is written (falls back to its value).
    pub fn key(&self, path: &str) -> Option<Pos> {
        self.keys.get(path).copied().or_else(|| self.value(path))
    }
}

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, next: usize },
}

struct Walker {
    stack: Vec<Frame>,
    loc: Locations,
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

impl Walker {
    /// The path of a node that starts now; `None` when it is a mapping key.
    fn node_path(&mut self, scalar: Option<&str>, pos: Pos) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Seq { path, next }) => {
                let p = format!("{path}[{next}]");
                *next += 1;
                Some(p)
            }
            Some(Frame::Map { path, key }) => match key.take() {
                Some(k) => Some(join(path, &k)),
                None => {
                    let k = scalar.unwrap_or("?").to_string();
                    // A block mapping's own mark is unreliable; its first key
                    // is where a reader sees it start.
                    if !self.loc.keys.keys().any(|p| p.starts_with(path.as_str()) && p.len() > path.len()) {
                        self.loc.values.insert(path.clone(), pos);
                    }
                    self.loc.keys.insert(join(path, &k), pos);
                    *key = Some(k);
                    None
                }
            },
        }
    }
}

impl MarkedEventReceiver for Walker {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let pos = Pos { line: mark.line(), col: mark.col() + 1 };
        match ev {
            Event::Scalar(ref v, ..) => {
                if let Some(p) = self.node_path(Some(v), pos) {
                    self.loc.values.insert(p, pos);
                }
            }
            Event::Alias(_) => {
                if let Some(p) = self.node_path(None, pos) {
                    self.loc.values.insert(p, pos);
                }
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                let is_map = matches!(ev, Event::MappingStart(..));
                let path = self.node_path(None, pos).unwrap_or_default();
                self.loc.values.insert(path.clone(), pos);
                self.stack.push(if is_map { Frame::Map { path, key: None } } else { Frame::Seq { path, next: 0 } });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            _ => {}
        }
    }
}

/// Locations of every node; an unparsable document gives none (serde_yaml
/// reports the syntax error with its own position).
pub fn locate(text: &str) -> Locations {
    let mut w = Walker { stack: Vec::new(), loc: Locations::default() };
    let mut parser = Parser::new_from_str(text);
    let _ = parser.load(&mut w, false);
    w.loc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_values_and_keys() {
        let text = "target: host\nstages:\n  - layers: 0-3\n    embedding: true\n  - layers: 4-7\n";
        let l = locate(text);
        assert_eq!(l.value("target"), Some(Pos { line: 1, col: 9 }));
        assert_eq!(l.value("stages[0].layers"), Some(Pos { line: 3, col: 13 }));
        assert_eq!(l.key("stages[0].embedding"), Some(Pos { line: 4, col: 5 }));
        assert_eq!(l.value("stages[1].layers"), Some(Pos { line: 5, col: 13 }));
        assert_eq!(l.value("stages[1]"), Some(Pos { line: 5, col: 5 }));
    }
}
