//! A JSON object read with its keys in order and duplicates refused:
//! `serde_json::Value` keeps only the last of two equal keys, which would let
//! a damaged header or index name one tensor twice without anyone noticing.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use std::collections::BTreeSet;
use std::fmt;

pub struct UniqueMap(pub Vec<(String, serde_json::Value)>);

/// What went wrong reading a [`UniqueMap`]: the key that repeats, or
/// serde_json's own message.
pub fn duplicate_key(message: &str) -> Option<&str> {
    message.strip_prefix("duplicate key `").and_then(|m| m.split('`').next())
}

impl<'de> Deserialize<'de> for UniqueMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = UniqueMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UniqueMap, A::Error> {
                let mut seen = BTreeSet::new();
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!("duplicate key `{key}`")));
                    }
                    let value: serde_json::Value = map.next_value()?;
                    out.push((key, value));
                }
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(V)
    }
}
