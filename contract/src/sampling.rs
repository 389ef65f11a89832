//! Sampling parameters and what crosses the boundary between the last
//! stage's books and its sampler (host or device): the parameters with
//! their one text form, the sampling table's row layout ([`row`],
//! [`row_words`], [`row_params`]), the seen-id and allowed-token bitmaps,
//! and the constants the device sampler writes into its code. The host
//! sampler itself, the definition every target's sampler agrees with, is
//! `m3c_sampler`.
//!
//! One table, [`FIELDS`] (each field's name, flag, kind, help and slot in
//! the row), drives the text form, [`SamplingOverrides`] (its merge, and its
//! reading of a request's or `generation_config.json`'s JSON), the row the
//! device sampler reads, `m3c run`'s flags and the servers' field checks. A
//! new field is an entry there and a field of the two structs, plus the
//! device sampler's read of its slot when it acts on the logits.
//! [`SamplingOverrides`] is the one merge of defaults: a request's or a
//! prompts-file line's fields, over the flags, over the checkpoint's
//! `generation_config.json`, over a base.

/// The sampling parameters of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (the first maximum).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches
    /// `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = none).
    pub min_p: f32,
    /// Above 1 makes tokens already in the sequence less likely (1 = none), as
    /// Hugging Face does: a positive logit is divided by it, a negative one
    /// multiplied.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every
    /// token the sequence has generated (0 = none; the prompt does not count).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a token's logit as many
    /// times as the sequence has generated it (0 = none).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding: `m3c run`'s base.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: 0,
    };
    /// OpenAI's defaults (temperature 1, every token kept): `m3c serve`'s
    /// base, as vLLM's.
    pub const OPENAI: SamplingParams = SamplingParams { temperature: 1.0, ..SamplingParams::GREEDY };

    /// Greedy with nothing to adjust: the argmax kernels' id is the answer.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0 && !self.adjusts()
    }

    /// Whether the presence or frequency penalty is on: the sequence's draws
    /// then take an additive bias row (see [`row::BIAS_ROW`]).
    pub fn adjusts(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Every field by name, in [`FIELDS`]' order: the one text form of
    /// sampling parameters wherever they cross a process boundary (stage
    /// arguments, the serve protocol).
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        FIELDS.iter().map(|f| (f.name, (f.get)(self).to_string())).collect()
    }

    /// Sets the field `name` from its text form; `Ok(false)` when no field
    /// has that name (the caller decides whether that is an error).
    pub fn set_field(&mut self, name: &str, value: &str) -> Result<bool, String> {
        let Some(f) = field(name) else { return Ok(false) };
        (f.set)(self, f.parse(value)?);
        Ok(true)
    }

    /// `name=value,...` of every field ([`SamplingParams::fields`]).
    pub fn encode(&self) -> String {
        self.fields().iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }

    /// The parameters of `text` (`name=value,...`) over `base`, checked.
    pub fn decode(text: &str, base: SamplingParams) -> Result<SamplingParams, String> {
        let mut p = base;
        for pair in text.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| format!("`{pair}`: expected name=value"))?;
            if !p.set_field(k, v)? {
                return Err(format!("`{k}` is not a sampling parameter"));
            }
        }
        p.check()?;
        Ok(p)
    }

    /// Checks every field's range; the message names the field.
    pub fn check(&self) -> Result<(), String> {
        let SamplingParams { temperature: t, top_p, min_p, repetition_penalty: r, presence_penalty, frequency_penalty, .. } = *self;
        // Below 1e-5 (vLLM's threshold) logit / temperature overflows f32.
        if !(t.is_finite() && (t == 0.0 || t >= 1e-5)) {
            return Err(format!("temperature {t}: expected 0 (greedy) or a number ≥ 1e-5"));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("top_p {top_p}: expected a number in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&min_p) {
            return Err(format!("min_p {min_p}: expected a number in [0, 1]"));
        }
        if !(r.is_finite() && r > 0.0) {
            return Err(format!("repetition_penalty {r}: expected a positive number"));
        }
        // OpenAI's range.
        for (name, v) in [("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} {v}: expected a number from -2 to 2"));
            }
        }
        Ok(())
    }
}

/// The sampling fields one source sets, each optional: a request, a line
/// of a prompts file, the command line, or a checkpoint's
/// `generation_config.json`. Sources layer with [`SamplingOverrides::or`]
/// and land on a base with [`SamplingOverrides::over`], so the precedence
/// (request, then command line, then checkpoint, then the built-in base)
/// is written once.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
}

impl SamplingOverrides {
    /// `self`'s fields where set, else `lower`'s.
    pub fn or(self, lower: SamplingOverrides) -> SamplingOverrides {
        let mut out = self;
        for f in FIELDS {
            if (f.get_override)(&out).is_none() {
                (f.set_override)(&mut out, (f.get_override)(&lower));
            }
        }
        out
    }

    /// `base` with `self`'s fields where set (not checked: the caller checks
    /// and names the source of a bad value).
    pub fn over(self, base: SamplingParams) -> SamplingParams {
        let mut p = base;
        for f in FIELDS {
            if let Some(v) = (f.get_override)(&self) {
                (f.set)(&mut p, v);
            }
        }
        p
    }

    pub fn is_empty(&self) -> bool {
        *self == SamplingOverrides::default()
    }

    /// Every field [`FIELDS`] names that `m` (a request's or a checkpoint's
    /// JSON object) sets; null counts as absent. The error names the field.
    pub fn from_json(m: &serde_json::Map<String, serde_json::Value>) -> Result<SamplingOverrides, (&'static str, String)> {
        let mut o = SamplingOverrides::default();
        for f in FIELDS {
            match m.get(f.name) {
                None | Some(serde_json::Value::Null) => {}
                Some(v) => (f.set_override)(&mut o, Some(f.from_json(v).map_err(|e| (f.name, e))?)),
            }
        }
        Ok(o)
    }
}

/// A sampling field's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldValue {
    Real(f32),
    Count(u64),
}

impl std::fmt::Display for FieldValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FieldValue::Real(v) => write!(f, "{v}"),
            FieldValue::Count(v) => write!(f, "{v}"),
        }
    }
}

/// What values a field takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A finite number (negative ones allowed).
    Real,
    /// A count; vLLM's -1 means 0 (`top_k: -1`: no top-k).
    Count,
    /// A 64-bit seed.
    Seed,
}

/// Where a sampling-table row ([`row_words`]) keeps a field: the low or
/// high half of a word (f32 bits), or a whole word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Low(usize),
    High(usize),
    Word(usize),
}

/// One sampling field: its name (the request field, the `--kebab-case`
/// flag, the `generation_config.json` key and its word in the text form),
/// its kind, its flag's help and value name, its place in the sampling
/// table's row, and how to read and write it in [`SamplingParams`] and
/// [`SamplingOverrides`]. [`FIELDS`] lists them all: every parser, flag,
/// encoding and the device row iterate it, so a new field is an entry
/// there (and a field of the two structs), plus the device sampler's read
/// of its slot when it acts on the logits.
pub struct Field {
    pub name: &'static str,
    /// The flag's name without its dashes (`top-k`).
    pub long: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub value_name: &'static str,
    pub slot: Slot,
    pub get: fn(&SamplingParams) -> FieldValue,
    pub set: fn(&mut SamplingParams, FieldValue),
    pub get_override: fn(&SamplingOverrides) -> Option<FieldValue>,
    pub set_override: fn(&mut SamplingOverrides, Option<FieldValue>),
}

impl Field {
    /// A value from its text form; the error names the field.
    pub fn parse(&self, text: &str) -> Result<FieldValue, String> {
        let name = self.name;
        match self.kind {
            Kind::Real => text
                .parse::<f32>()
                .ok()
                .filter(|v| v.is_finite())
                .map(FieldValue::Real)
                .ok_or_else(|| format!("{name} `{text}`: expected a number")),
            Kind::Count if text == "-1" => Ok(FieldValue::Count(0)),
            Kind::Count | Kind::Seed => text
                .parse::<u64>()
                .ok()
                .filter(|&v| self.kind == Kind::Seed || usize::try_from(v).is_ok())
                .map(FieldValue::Count)
                .ok_or_else(|| format!("{name} `{text}`: expected an unsigned integer")),
        }
    }

    /// A value from a JSON number; the error says what was expected.
    pub fn from_json(&self, v: &serde_json::Value) -> Result<FieldValue, String> {
        let name = self.name;
        match (self.kind, v) {
            (Kind::Real, serde_json::Value::Number(n)) => n
                .as_f64()
                .filter(|v| v.is_finite())
                .map(|v| FieldValue::Real(v as f32))
                .ok_or_else(|| format!("`{name}` must be a finite number")),
            (Kind::Count, serde_json::Value::Number(n)) if n.as_i64() == Some(-1) => Ok(FieldValue::Count(0)),
            (Kind::Count | Kind::Seed, serde_json::Value::Number(n)) => {
                n.as_u64().map(FieldValue::Count).ok_or_else(|| format!("`{name}` must be a non-negative integer"))
            }
            (Kind::Real, _) => Err(format!("`{name}` must be a number, not {}", json_kind(v))),
            (_, _) => Err(format!("`{name}` must be an integer, not {}", json_kind(v))),
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A real field's accessors, by its name in both structs.
macro_rules! real_field {
    ($name:ident, $long:expr, $slot:expr, $value_name:expr, $help:expr) => {
        Field {
            name: stringify!($name),
            long: $long,
            kind: Kind::Real,
            help: $help,
            value_name: $value_name,
            slot: $slot,
            get: |p| FieldValue::Real(p.$name),
            set: |p, v| {
                if let FieldValue::Real(x) = v {
                    p.$name = x;
                }
            },
            get_override: |o| o.$name.map(FieldValue::Real),
            set_override: |o, v| {
                o.$name = match v {
                    Some(FieldValue::Real(x)) => Some(x),
                    _ => None,
                }
            },
        }
    };
}

/// Every sampling field, in the order of their text form.
pub const FIELDS: &[Field] = &[
    real_field!(temperature, "temperature", Slot::Low(row::TEMPERATURE_TOP_P), "T", "Sampling temperature; 0 = greedy"),
    Field {
        name: "top_k",
        long: "top-k",
        kind: Kind::Count,
        help: "Sample among the K most likely tokens only (0 or -1 = all)",
        value_name: "K",
        slot: Slot::Word(row::TOP_K),
        get: |p| FieldValue::Count(p.top_k as u64),
        set: |p, v| {
            if let FieldValue::Count(k) = v {
                p.top_k = usize::try_from(k).unwrap_or(usize::MAX);
            }
        },
        get_override: |o| o.top_k.map(|k| FieldValue::Count(k as u64)),
        set_override: |o, v| {
            o.top_k = match v {
                Some(FieldValue::Count(k)) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
                _ => None,
            }
        },
    },
    real_field!(
        top_p,
        "top-p",
        Slot::High(row::TEMPERATURE_TOP_P),
        "P",
        "Sample among the most likely tokens that together reach probability P (1 = all)"
    ),
    real_field!(min_p, "min-p", Slot::Low(row::MIN_P_PENALTY), "P", "Drop tokens less likely than P times the most likely one (0 = none)"),
    real_field!(
        repetition_penalty,
        "repetition-penalty",
        Slot::High(row::MIN_P_PENALTY),
        "R",
        "Above 1, tokens already in the sequence become less likely (Hugging Face's rule; 1 = none)"
    ),
    real_field!(
        presence_penalty,
        "presence-penalty",
        Slot::Low(row::PRESENCE_FREQUENCY),
        "P",
        "OpenAI's presence penalty (-2 to 2): subtracted from the logit of every token already generated (0 = none)"
    ),
    real_field!(
        frequency_penalty,
        "frequency-penalty",
        Slot::High(row::PRESENCE_FREQUENCY),
        "F",
        "OpenAI's frequency penalty (-2 to 2): subtracted once per time a token was already generated (0 = none)"
    ),
    Field {
        name: "seed",
        long: "seed",
        kind: Kind::Seed,
        help: "Seed of the draws: with it, a prompt's tokens are the same at any pp, batch or thread count",
        value_name: "SEED",
        slot: Slot::Word(row::SEED),
        get: |p| FieldValue::Count(p.seed),
        set: |p, v| {
            if let FieldValue::Count(s) = v {
                p.seed = s;
            }
        },
        get_override: |o| o.seed.map(FieldValue::Count),
        set_override: |o, v| {
            o.seed = match v {
                Some(FieldValue::Count(s)) => Some(s),
                _ => None,
            }
        },
    },
];

/// The field named `name`.
pub fn field(name: &str) -> Option<&'static Field> {
    FIELDS.iter().find(|f| f.name == name)
}

/// The constants of `m3c_sampler::exp_neg`, which the device sampler writes into its
/// code bit for bit so that it computes the same weights.
pub mod exp_consts {
    pub const LOG2_E: f32 = std::f32::consts::LOG2_E;
    /// Adding 1.5·2^23 pushes the fraction out of the mantissa: round to
    /// nearest without SSE4.1's roundps.
    pub const ROUND: f32 = 12_582_912.0;
    /// ln 2 split in two so that n·LN2_HI is exact.
    pub const LN2_HI: f32 = 0.693_145_75;
    pub const LN2_LO: f32 = 1.428_606_8e-6;
    /// Taylor coefficients of e^r, innermost (1/720) first, for Horner's scheme.
    pub const POLY: [f32; 7] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
    /// Past this, exp(-d) is taken as 0 (f32 would go subnormal).
    pub const CUTOFF: f32 = 87.0;
}

/// A token's weight is `exp(x - max)` in units of 2^-30: the most likely
/// token weighs exactly 2^30.
pub const WEIGHT_ONE: f32 = 1_073_741_824.0;

/// Words of a seen-id bitmap over a vocabulary of `vocab` ids.
pub fn seen_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// The bitmap of the ids in `ids` (bit `i % 32` of word `i / 32`): which
/// tokens the repetition penalty applies to. Ids outside the vocabulary are
/// ignored.
pub fn seen_bitmap(ids: impl IntoIterator<Item = u32>, vocab: usize) -> Vec<u32> {
    let mut seen = vec![0u32; seen_words(vocab)];
    for id in ids {
        if (id as usize) < vocab {
            seen[id as usize / 32] |= 1 << (id % 32);
        }
    }
    seen
}

/// Words per row of the sampling table that the stage entry hands its
/// sampling kernel (`[rows, ROW_WORDS]` i64), and what each holds. Words 8
/// and up are reserved for the request fields OpenAI clients send that act
/// on the logits (named below); until a sampler reads one it is 0, which
/// every one of them defines as "off", so the table's width and the
/// kernels' signature do not change when they land.
pub const ROW_WORDS: usize = 16;

/// OpenAI's bound on a `logit_bias` value.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Bitmap rows per drawing slot of a step (the seen-id and allowed-token
/// bitmaps' buffer). A step has a slot per segment, and a verify segment
/// (speculative decoding) one per row, since each of its rows draws: row
/// `k` is slot `k`'s seen ids (the repetition penalty), row `slots + k`
/// its allowed tokens (structured output).
pub const BITMAP_ROWS: usize = 2;
pub mod row {
    /// Temperature (f32 bits, low half) and top-p (f32 bits, high half).
    pub const TEMPERATURE_TOP_P: usize = 0;
    /// Min-p (low half) and the repetition penalty (high half), f32 bits.
    pub const MIN_P_PENALTY: usize = 1;
    pub const TOP_K: usize = 2;
    pub const SEED: usize = 3;
    pub const STEP: usize = 4;
    pub const REQUEST: usize = 5;
    /// Bit 0: [`SAMPLE`] (rows that give no token are only checked); bits
    /// 32 and up: the row of the seen-id bitmaps that belongs to this row's
    /// sequence.
    pub const FLAGS: usize = 6;
    /// Written by the sampler: how many of the row's logits are NaN or ±∞.
    pub const NON_FINITE: usize = 7;
    /// Presence (low half) and frequency (high half) penalties, f32 bits
    /// (0 = none). The kernel reads the bias row they make, not these.
    pub const PRESENCE_FREQUENCY: usize = 8;
    /// Reserved: min tokens (the EOS ids are masked until the sequence has
    /// this many; 0 = none).
    pub const MIN_TOKENS: usize = 9;
    /// Reserved: how many most likely alternatives to report with each
    /// token's log-probability (logprobs; 0 = none).
    pub const LOGPROBS: usize = 10;
    /// 1 + the row of the step's bias buffer (`[rows, vocab]` f32, a
    /// `m3c_sampler::BiasRow` each) added to this row's logits before anything
    /// else (`logit_bias`, presence and frequency penalties); 0 = none.
    pub const BIAS_ROW: usize = 11;
    /// 1 + the row of the step's bitmaps (the seen-id bitmaps' buffer)
    /// that holds the tokens this row may draw (structured output: a token
    /// whose bit is 0 weighs nothing); 0 = every token allowed.
    pub const TOKEN_MASK: usize = 12;
    /// 1 + how many alternatives to report with each prompt token's
    /// log-probability (prompt logprobs; 0 = none). Read by the books, not
    /// the kernel.
    pub const PROMPT_LOGPROBS: usize = 13;
    pub const SAMPLE: i64 = 1;
}

/// The sampling-table row of a draw (`sample` = false: a row that gives no
/// token, whose logits are only checked), whose sequence's seen-id bitmap is
/// row `seen_row` of the bitmaps.
pub fn row_words(p: &SamplingParams, request: u64, step: u64, sample: bool, seen_row: usize) -> [i64; ROW_WORDS] {
    let mut w = [0i64; ROW_WORDS];
    for f in FIELDS {
        let bits = |v: FieldValue| match v {
            FieldValue::Real(x) => x.to_bits() as u64,
            FieldValue::Count(n) => n,
        };
        let v = bits((f.get)(p));
        match f.slot {
            Slot::Low(k) => w[k] = ((w[k] as u64 & !0xFFFF_FFFF) | v) as i64,
            Slot::High(k) => w[k] = ((w[k] as u64 & 0xFFFF_FFFF) | v << 32) as i64,
            Slot::Word(k) => w[k] = v as i64,
        }
    }
    w[row::STEP] = step as i64;
    w[row::REQUEST] = request as i64;
    w[row::FLAGS] = if sample { row::SAMPLE } else { 0 } | (seen_row as i64) << 32;
    w
}

/// The seen-bitmap row a table row names.
pub fn seen_row(w: &[i64; ROW_WORDS]) -> usize {
    (w[row::FLAGS] as u64 >> 32) as usize
}

/// The inverse of [`row_words`]: the parameters, request, step and whether
/// the row gives a token.
pub fn row_params(w: &[i64; ROW_WORDS]) -> (SamplingParams, u64, u64, bool) {
    let mut p = SamplingParams::GREEDY;
    for f in FIELDS {
        let bits = match f.slot {
            Slot::Low(k) => w[k] as u64 & 0xFFFF_FFFF,
            Slot::High(k) => w[k] as u64 >> 32,
            Slot::Word(k) => w[k] as u64,
        };
        let v = match f.kind {
            Kind::Real => FieldValue::Real(f32::from_bits(bits as u32)),
            Kind::Count | Kind::Seed => FieldValue::Count(bits),
        };
        (f.set)(&mut p, v);
    }
    (p, w[row::REQUEST] as u64, w[row::STEP] as u64, w[row::FLAGS] & row::SAMPLE != 0)
}

/// The bias row a table row names, if any.
pub fn bias_row(w: &[i64; ROW_WORDS]) -> Option<usize> {
    usize::try_from(w[row::BIAS_ROW]).ok().and_then(|m| m.checked_sub(1))
}

/// The allowed-token bitmap row a table row names, if any.
pub fn mask_row(w: &[i64; ROW_WORDS]) -> Option<usize> {
    usize::try_from(w[row::TOKEN_MASK]).ok().and_then(|m| m.checked_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_table_is_every_field_once_and_drives_the_row_and_text_forms() {
        let names: Vec<&str> = FIELDS.iter().map(|f| f.name).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(names.len(), unique.len(), "a field twice: {names:?}");
        for f in FIELDS {
            assert_eq!(f.long, f.name.replace('_', "-"), "{}: the flag is the name in kebab case", f.name);
        }
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: -0.5,
            frequency_penalty: 0.25,
            seed: u64::MAX,
        };
        let w = row_words(&p, 3, 9, true, 2);
        assert_eq!(row_params(&w), (p, 3, 9, true));
        assert_eq!(seen_row(&w), 2);
        // The layout the device sampler reads (kernels/src/ops/sample.rs).
        assert_eq!(w[row::TEMPERATURE_TOP_P] as u64, 0.7f32.to_bits() as u64 | (0.95f32.to_bits() as u64) << 32);
        assert_eq!((w[row::TOP_K], w[row::SEED] as u64), (40, u64::MAX));
        assert_eq!(SamplingParams::decode(&p.encode(), SamplingParams::GREEDY), Ok(p));
        let o =
            SamplingOverrides::from_json(serde_json::json!({"top_k": -1, "temperature": 0.5, "other": 1}).as_object().unwrap()).unwrap();
        assert_eq!(o, SamplingOverrides { top_k: Some(0), temperature: Some(0.5), ..Default::default() });
        let e = SamplingOverrides::from_json(serde_json::json!({"top_p": "high"}).as_object().unwrap()).unwrap_err();
        assert_eq!(e.0, "top_p");
        assert!(e.1.contains("must be a number"), "{}", e.1);
    }

    #[test]
    fn overrides_layer_request_over_flags_over_checkpoint_over_base() {
        let request = SamplingOverrides { temperature: Some(0.5), ..Default::default() };
        let flags = SamplingOverrides { temperature: Some(0.9), top_k: Some(5), seed: Some(7), ..Default::default() };
        let checkpoint = SamplingOverrides { top_k: Some(40), top_p: Some(0.8), ..Default::default() };
        let p = request.or(flags.or(checkpoint)).over(SamplingParams::OPENAI);
        assert_eq!(
            p,
            SamplingParams { temperature: 0.5, top_k: 5, top_p: 0.8, seed: 7, ..SamplingParams::GREEDY },
            "each field from the highest source that sets it"
        );
        assert!(SamplingOverrides::default().is_empty() && !request.is_empty());
        assert_eq!(SamplingOverrides::default().over(SamplingParams::GREEDY), SamplingParams::GREEDY);
    }
}
