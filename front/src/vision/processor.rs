//! MiniMax-M3's image processor (`MiniMaxM3VLImageProcessor`, default
//! settings; `../shared/spec/minimax-m3-vision.md` §2), reproducing the
//! reference's `pixel_values` exactly: decode (PNG, JPEG, WebP, a GIF's
//! first frame), RGB with alpha composited over white as Pillow does,
//! `smart_resize` to multiples of 28, torchvision's antialiased bicubic
//! resize on uint8 (its fixed-point path, not Pillow's), CLIP
//! normalisation in f32, and patch rows of 1176 values in (c, t, y, x)
//! order, block-major over 2×2 merge groups.

use thiserror::Error;

/// The patch geometry is the images file's (the contract with the stage
/// that encodes images): 14-pixel patches, 2 frames, 2×2 merge groups, rows
/// of 1176 values.
pub use m3c_contract::images::{MERGE_SIDE as MERGE, PATCH, PATCH_ROW as ROW, TEMPORAL};
const FACTOR: usize = PATCH * MERGE;
pub const MIN_PIXELS: usize = 56 * 56;
pub const MAX_PIXELS: usize = 672 * 672;
// OpenAI CLIP's constants as the reference writes them; like it, m3c rounds
// them to f32 before use (fp32(mean)·255), so the extra digits are intended.
#[allow(clippy::excessive_precision)]
const MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
#[allow(clippy::excessive_precision)]
const STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

#[derive(Debug, Error, PartialEq)]
pub enum ImageError {
    #[error("{what}: not an image m3c can read (PNG, JPEG, WebP or GIF): {why}")]
    Decode { what: String, why: String },
    #[error("{what}: {h}×{w} pixels: the sides differ by more than 200× (the reference refuses such images)")]
    Aspect { what: String, h: usize, w: usize },
    #[error("{what}: an empty image ({h}×{w})")]
    Empty { what: String, h: usize, w: usize },
}

/// An image as the tower takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Processed {
    /// `[patches, ROW]` f32, row-major.
    pub pixel_values: Vec<f32>,
    /// (t, gh, gw): 1 frame, patches down and across.
    pub grid: [usize; 3],
}

impl Processed {
    /// Rows of `pixel_values`.
    pub fn patches(&self) -> usize {
        self.grid.iter().product()
    }

    /// Placeholder tokens the image takes in the prompt (one per 2×2 merge group).
    pub fn tokens(&self) -> usize {
        self.patches() / (MERGE * MERGE)
    }
}

/// An H×W×3 RGB image, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Rgb {
    pub h: usize,
    pub w: usize,
    pub data: Vec<u8>,
}

/// Python's round (half to even) of a double.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

/// The reference's `smart_resize`: the target (height, width), multiples of
/// 28 holding between MIN_PIXELS and MAX_PIXELS pixels, aspect kept.
pub fn smart_resize(h: usize, w: usize, what: &str) -> Result<(usize, usize), ImageError> {
    smart_resize_within(h, w, MIN_PIXELS, MAX_PIXELS, what)
}

/// `smart_resize` with the pixel bounds given (the video processor's are
/// its own: 4·28·28 to 768·28·28 per frame).
pub fn smart_resize_within(h: usize, w: usize, min_pixels: usize, max_pixels: usize, what: &str) -> Result<(usize, usize), ImageError> {
    if h == 0 || w == 0 {
        return Err(ImageError::Empty { what: what.into(), h, w });
    }
    if h.max(w) as f64 / h.min(w) as f64 > 200.0 {
        return Err(ImageError::Aspect { what: what.into(), h, w });
    }
    let f = FACTOR as f64;
    let (hf, wf) = (h as f64, w as f64);
    let mut rh = (round_half_even(hf / f) * f) as usize;
    let mut rw = (round_half_even(wf / f) * f) as usize;
    if rh * rw > max_pixels {
        let beta = (hf * wf / max_pixels as f64).sqrt();
        rh = FACTOR.max(((hf / beta / f).floor() * f) as usize);
        rw = FACTOR.max(((wf / beta / f).floor() * f) as usize);
    } else if rh * rw < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        rh = ((hf * beta / f).ceil() * f) as usize;
        rw = ((wf * beta / f).ceil() * f) as usize;
    }
    Ok((rh, rw))
}

/// Pillow's `alpha_composite` of one RGBA pixel over opaque white, in its
/// fixed point (7 bits of precision, division by 255 by shifts).
fn over_white(r: u8, g: u8, b: u8, a: u8) -> [u8; 3] {
    if a == 0 {
        return [255; 3];
    }
    const PRECISION: u32 = 7;
    let div255 = |v: u32| ((v >> 8) + v) >> 8;
    let a = a as u32;
    let blend = 255 * (255 - a);
    let outa255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION) / outa255;
    let coef2 = 255 * (1 << PRECISION) - coef1;
    let mix = |s: u8| (div255(s as u32 * coef1 + 255 * coef2 + (0x80 << PRECISION)) >> PRECISION) as u8;
    [mix(r), mix(g), mix(b)]
}

/// Decodes an image file's bytes into RGB: greyscale replicated, alpha (and
/// palette transparency) composited over white. A GIF gives its first frame.
pub fn decode(bytes: &[u8], what: &str) -> Result<Rgb, ImageError> {
    let bad = |e: image::ImageError| ImageError::Decode { what: what.into(), why: e.to_string() };
    let img = image::load_from_memory(bytes).map_err(bad)?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    if w == 0 || h == 0 {
        return Err(ImageError::Empty { what: what.into(), h, w });
    }
    let data = if img.color().has_alpha() {
        img.to_rgba8().pixels().flat_map(|p| over_white(p[0], p[1], p[2], p[3])).collect()
    } else {
        img.to_rgb8().into_raw()
    };
    Ok(Rgb { h, w, data })
}

/// The index range and int16 weights of torchvision's antialiased bicubic
/// resize along one axis (`_compute_index_ranges_int16_weights`): per output
/// pixel its first source pixel and weights, and the fixed-point precision.
fn weights(input: usize, output: usize) -> (Vec<(usize, Vec<i32>)>, u32) {
    // Keys' cubic with a = -0.5 (Pillow's, and torchvision's with antialias).
    let filter = |x: f64| -> f64 {
        let a = -0.5;
        let x = x.abs();
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
        } else {
            0.0
        }
    };
    let scale = input as f64 / output as f64;
    let support = if scale >= 1.0 { 4.0 * 0.5 * scale } else { 4.0 * 0.5 };
    let max_size = support.ceil() as usize * 2 + 1;
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut rows = Vec::with_capacity(output);
    let mut w_max = 0.0f64;
    for i in 0..output {
        let center = scale * (i as f64 + 0.5);
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xsize = (((center + support + 0.5) as i64).min(input as i64) - xmin as i64).clamp(0, max_size as i64) as usize;
        let mut w: Vec<f64> = (0..xsize).map(|j| filter((j as f64 + xmin as f64 - center + 0.5) * invscale)).collect();
        let total: f64 = w.iter().sum();
        if total != 0.0 {
            for v in &mut w {
                *v /= total;
                w_max = w_max.max(*v);
            }
        }
        rows.push((xmin, w));
    }
    let mut precision = 0u32;
    while precision < 22 {
        if (0.5 + w_max * (1u64 << (precision + 1)) as f64) as i64 >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let scaled = rows
        .into_iter()
        .map(|(xmin, w)| {
            let q = w
                .iter()
                .map(|&v| {
                    let v = v * (1u64 << precision) as f64;
                    (if v < 0.0 { -0.5 + v } else { 0.5 + v }) as i32 as i16 as i32
                })
                .collect();
            (xmin, q)
        })
        .collect();
    (scaled, precision)
}

/// One pass of the resize along an axis: `n` lines of `len` samples at
/// `stride` apart (lines `line_stride` apart) into `out_len` samples.
fn pass(src: &[u8], lines: usize, len: usize, along: usize, across: usize, out_len: usize) -> Vec<u8> {
    let (w, precision) = weights(len, out_len);
    let mut out = vec![0u8; lines * out_len];
    let round = 1i32 << (precision.max(1) - 1);
    for line in 0..lines {
        for (o, (xmin, k)) in w.iter().enumerate() {
            let mut acc = round;
            for (j, &kj) in k.iter().enumerate() {
                acc += src[line * across + (xmin + j) * along] as i32 * kj;
            }
            out[line * out_len + o] = (acc >> precision).clamp(0, 255) as u8;
        }
    }
    out
}

/// torchvision's `resize(uint8 CHW, (h, w), BICUBIC, antialias=True)`:
/// horizontal then vertical passes, each over uint8 with int16 weights; an
/// unchanged size returns the image as it is. In and out: CHW.
pub fn resize_chw(src: &[u8], h: usize, w: usize, oh: usize, ow: usize) -> Vec<u8> {
    let mut planes = Vec::with_capacity(3 * oh * ow);
    for c in 0..3 {
        let plane = &src[c * h * w..(c + 1) * h * w];
        // Rows of w samples → rows of ow.
        let horiz = if ow != w { pass(plane, h, w, 1, w, ow) } else { plane.to_vec() };
        // Columns of h samples (stride ow) → columns of oh; the pass writes
        // each column contiguously, so transpose back.
        let vert = if oh != h {
            let cols = pass(&horiz, ow, h, ow, 1, oh);
            let mut t = vec![0u8; oh * ow];
            for x in 0..ow {
                for y in 0..oh {
                    t[y * ow + x] = cols[x * oh + y];
                }
            }
            t
        } else {
            horiz
        };
        planes.extend(vert);
    }
    planes
}

/// HWC RGB → CHW.
pub fn to_chw(img: &Rgb) -> Vec<u8> {
    let n = img.h * img.w;
    let mut out = vec![0u8; 3 * n];
    for (i, px) in img.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = px[c];
        }
    }
    out
}

/// Normalises a resized CHW image (h, w multiples of 28) and lays it out as
/// patch rows: a still image fills both frames of its one temporal patch.
pub fn patchify(chw: &[u8], h: usize, w: usize) -> Processed {
    let pixel_values = patchify_frames(&[chw, chw], h, w);
    Processed { pixel_values, grid: [1, h / PATCH, w / PATCH] }
}

/// Normalises resized CHW frames (an even count, each h×w with sides
/// multiples of 28) into patch rows, as the reference's processors lay them
/// out: rows ordered (temporal patch, 2×2 block down, across, within the
/// block down, across), each row's values (channel, frame in the pair, y, x).
pub fn patchify_frames(frames: &[&[u8]], h: usize, w: usize) -> Vec<f32> {
    let m: [f32; 3] = std::array::from_fn(|c| MEAN[c] * 255.0);
    let s: [f32; 3] = std::array::from_fn(|c| STD[c] * 255.0);
    let (gh, gw) = (h / PATCH, w / PATCH);
    let gt = frames.len() / TEMPORAL;
    let mut pv = vec![0f32; gt * gh * gw * ROW];
    let mut r = 0;
    for pair in frames.chunks_exact(TEMPORAL) {
        for bh in 0..gh / MERGE {
            for bw in 0..gw / MERGE {
                for mh in 0..MERGE {
                    for mw in 0..MERGE {
                        let (top, left) = ((bh * MERGE + mh) * PATCH, (bw * MERGE + mw) * PATCH);
                        let row = &mut pv[r * ROW..(r + 1) * ROW];
                        for c in 0..3 {
                            for (t, chw) in pair.iter().enumerate() {
                                for y in 0..PATCH {
                                    for x in 0..PATCH {
                                        let v = chw[c * h * w + (top + y) * w + left + x] as f32;
                                        row[((c * TEMPORAL + t) * PATCH + y) * PATCH + x] = (v - m[c]) / s[c];
                                    }
                                }
                            }
                        }
                        r += 1;
                    }
                }
            }
        }
    }
    pv
}

/// The whole processor on decoded RGB.
pub fn process_rgb(img: &Rgb, what: &str) -> Result<Processed, ImageError> {
    let (oh, ow) = smart_resize(img.h, img.w, what)?;
    let chw = to_chw(img);
    let resized = if (oh, ow) == (img.h, img.w) { chw } else { resize_chw(&chw, img.h, img.w, oh, ow) };
    Ok(patchify(&resized, oh, ow))
}

/// The whole processor on an image file's bytes.
pub fn process(bytes: &[u8], what: &str) -> Result<Processed, ImageError> {
    process_rgb(&decode(bytes, what)?, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_rounds_half_to_even_and_keeps_the_pixel_bounds() {
        for ((h, w), want) in [
            ((56, 84), (56, 84)),
            ((70, 126), (56, 112)),
            ((30, 20), (84, 56)),
            ((480, 640), (476, 644)),
            ((1080, 1920), (504, 896)),
            ((1024, 1024), (672, 672)),
            ((3000, 4000), (560, 756)),
        ] {
            assert_eq!(smart_resize(h, w, "x").unwrap(), want, "{h}×{w}");
        }
        assert!(matches!(smart_resize(10, 2100, "x"), Err(ImageError::Aspect { .. })));
    }

    #[test]
    fn alpha_over_white_is_pillows() {
        assert_eq!(over_white(10, 20, 30, 255), [10, 20, 30]);
        assert_eq!(over_white(10, 20, 30, 0), [255, 255, 255]);
        let [r, ..] = over_white(0, 0, 0, 128);
        assert!((126..=128).contains(&r), "{r}");
    }
}
