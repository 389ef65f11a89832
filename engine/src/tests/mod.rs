//! The engine driven directly, as the runtime drives it, by a simulated
//! pipeline ([`sim`]): unit tests of each scheduling rule, and property
//! tests over random event sequences.

mod props;
mod rules;
mod sim;
mod speculation;
