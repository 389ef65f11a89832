//! Float encodings for writing checkpoints: bf16 and MXFP8 (e4m3fn + E8M0).

/// f32 → bf16 bits, round to nearest even.
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return 0x7FC0;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    ((b.wrapping_add(round)) >> 16) as u16
}

pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The value of an e4m3fn byte (bias 7, no infinities, 0x7F/0xFF are NaN):
/// the same definition the MXFP8 kernels decode with.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    m3c_kernels::fp8_e4m3_value(byte)
}

/// f32 → e4m3fn byte, round to nearest, ties to even, saturating at ±448.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(448.0);
    // Positive codes 0x00..=0x7E are ordered by value: binary search the nearest.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) { lo } else { hi };
    if code == 0 {
        0
    } else {
        sign | code
    }
}

/// 2^(s − 127) for an E8M0 scale byte (255 is NaN).
pub fn e8m0_to_f32(s: u8) -> f32 {
    if s == 255 {
        f32::NAN
    } else {
        2f32.powi(s as i32 - 127)
    }
}

/// Quantizes a row-major `[out, inp]` matrix to MXFP8 with 1×`block` blocks:
/// each block's scale is the smallest power of two that brings its largest
/// magnitude within ±448. Returns (fp8 bytes, scale bytes `[out, inp/block]`).
pub fn mxfp8_quantize(w: &[f32], inp: usize, block: usize) -> (Vec<u8>, Vec<u8>) {
    let mut q = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / block);
    for chunk in w.chunks(block) {
        debug_assert_eq!(inp % block, 0);
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = if amax == 0.0 { -127 } else { (amax / 448.0).log2().ceil() as i32 };
        let e = e.clamp(-127, 127);
        let s = 2f32.powi(e);
        scales.push((e + 127) as u8);
        q.extend(chunk.iter().map(|v| e4m3_from_f32(v / s)));
    }
    (q, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_code() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() || b == 0x80 {
                continue;
            }
            assert_eq!(e4m3_from_f32(v), b, "code {b:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    // The literals are exact f32 values (1 + 2^-8, 1 + 3·2^-8): the tie cases.
    #[allow(clippy::excessive_precision)]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3F80);
        assert_eq!(bf16_to_f32(bf16_bits(1.00390625)), 1.0); // exactly half way: to even
        assert_eq!(bf16_to_f32(bf16_bits(1.01171875)), 1.015625);
    }
}
