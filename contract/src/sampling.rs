//! Sampling parameters and what crosses the boundary between the last
//! stage's books and its sampler (host or device): the parameters with
//! their one text form, the sampling table's row layout ([`row`],
//! [`row_words`], [`row_params`]), the seen-id and allowed-token bitmaps,
//! and the constants the device sampler writes into its code. The host
//! sampler itself, the definition every target's sampler agrees with, is
//! `m3c_sampler`.

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

    /// Every field by name, in one order: the one text form of sampling
    /// parameters wherever they cross a process boundary (stage arguments,
    /// the serve protocol). A new field is a new line here and in
    /// [`SamplingParams::set_field`]; no positional format to renumber.
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("temperature", self.temperature.to_string()),
            ("top_k", self.top_k.to_string()),
            ("top_p", self.top_p.to_string()),
            ("min_p", self.min_p.to_string()),
            ("repetition_penalty", self.repetition_penalty.to_string()),
            ("presence_penalty", self.presence_penalty.to_string()),
            ("frequency_penalty", self.frequency_penalty.to_string()),
            ("seed", self.seed.to_string()),
        ]
    }

    /// Sets the field `name` from its text form; `Ok(false)` when no field
    /// has that name (the caller decides whether that is an error).
    pub fn set_field(&mut self, name: &str, value: &str) -> Result<bool, String> {
        let num = || value.parse::<f32>().ok().filter(|v| v.is_finite()).ok_or_else(|| format!("{name} `{value}`: expected a number"));
        let int = || value.parse::<u64>().map_err(|_| format!("{name} `{value}`: expected an unsigned integer"));
        match name {
            "temperature" => self.temperature = num()?,
            "top_k" => self.top_k = usize::try_from(int()?).map_err(|_| format!("top_k `{value}` is too large"))?,
            "top_p" => self.top_p = num()?,
            "min_p" => self.min_p = num()?,
            "repetition_penalty" => self.repetition_penalty = num()?,
            "presence_penalty" => self.presence_penalty = num()?,
            "frequency_penalty" => self.frequency_penalty = num()?,
            "seed" => self.seed = int()?,
            _ => return Ok(false),
        }
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
        SamplingOverrides {
            temperature: self.temperature.or(lower.temperature),
            top_k: self.top_k.or(lower.top_k),
            top_p: self.top_p.or(lower.top_p),
            min_p: self.min_p.or(lower.min_p),
            repetition_penalty: self.repetition_penalty.or(lower.repetition_penalty),
            presence_penalty: self.presence_penalty.or(lower.presence_penalty),
            frequency_penalty: self.frequency_penalty.or(lower.frequency_penalty),
            seed: self.seed.or(lower.seed),
        }
    }

    /// `base` with `self`'s fields where set (not checked: the caller checks
    /// and names the source of a bad value).
    pub fn over(self, base: SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(base.frequency_penalty),
            seed: self.seed.unwrap_or(base.seed),
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == SamplingOverrides::default()
    }
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

/// Bitmap rows per sequence of a step (the seen-id and allowed-token
/// bitmaps' buffer): row `k` is sequence `k`'s seen ids (the repetition
/// penalty), row `sequences + k` its allowed tokens (structured output).
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
    let pair = |lo: f32, hi: f32| (lo.to_bits() as u64 | (hi.to_bits() as u64) << 32) as i64;
    let mut w = [0i64; ROW_WORDS];
    w[row::TEMPERATURE_TOP_P] = pair(p.temperature, p.top_p);
    w[row::MIN_P_PENALTY] = pair(p.min_p, p.repetition_penalty);
    w[row::PRESENCE_FREQUENCY] = pair(p.presence_penalty, p.frequency_penalty);
    w[row::TOP_K] = p.top_k as i64;
    w[row::SEED] = p.seed as i64;
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
    let half = |v: i64, hi: bool| f32::from_bits(if hi { (v as u64 >> 32) as u32 } else { v as u32 });
    let p = SamplingParams {
        temperature: half(w[row::TEMPERATURE_TOP_P], false),
        top_p: half(w[row::TEMPERATURE_TOP_P], true),
        min_p: half(w[row::MIN_P_PENALTY], false),
        repetition_penalty: half(w[row::MIN_P_PENALTY], true),
        presence_penalty: half(w[row::PRESENCE_FREQUENCY], false),
        frequency_penalty: half(w[row::PRESENCE_FREQUENCY], true),
        top_k: w[row::TOP_K] as u64 as usize,
        seed: w[row::SEED] as u64,
    };
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
