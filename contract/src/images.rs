//! The images of a run, as the front hands them to the stage that encodes
//! them: a safetensors file with, for each sequence `N` that has images,
//! `seqN.pixel_values` (`[P, patch_row]` f32, the processor's normalised
//! patch rows, images in prompt order) and `seqN.image_grid_thw` (`[n, 3]`
//! i64, one `(t, h, w)` patch grid per image). The front writes it
//! ([`encode`]); the stage reads it back through [`decode`], which checks
//! everything a stage relies on, so a damaged file is an error, never a
//! wrong index.

use crate::checkpoint::{parse_header, HeaderProblem};
use crate::dtype::DType;
use std::collections::BTreeMap;

/// One sequence's images: each image's patch grid and every patch row.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqImages {
    /// `(t, h, w)` patch counts of each image.
    pub grids: Vec<[usize; 3]>,
    /// `[Σ t·h·w, patch_row]` f32, row-major.
    pub pixels: Vec<f32>,
}

/// The largest images file a stage reads (about 90 images of 672×672).
pub const MAX_BYTES: u64 = 1 << 30;
/// The 2×2 patch merge: a grid's `h` and `w` must be even.
pub const MERGE_SIDE: usize = 2;
/// Patch side in pixels of the rows the front's image processor makes; the
/// compiler refuses a vision tower of another geometry.
pub const PATCH: usize = 14;
/// A still image fills both temporal slots.
pub const TEMPORAL: usize = 2;
/// Values per patch row: 3 channels × 2 frames × 14 × 14.
pub const PATCH_ROW: usize = 3 * TEMPORAL * PATCH * PATCH;

impl SeqImages {
    /// Patch rows of all the images.
    pub fn patches(&self) -> usize {
        self.grids.iter().map(|g| g[0] * g[1] * g[2]).sum()
    }

    /// Image tokens (placeholders) of each image: its patch rows / 4.
    pub fn tokens(&self) -> Vec<usize> {
        self.grids.iter().map(|g| g[0] * g[1] * g[2] / (MERGE_SIDE * MERGE_SIDE)).collect()
    }

    /// Each patch row's `(t, h, w)`, in the processor's block-major row
    /// order (vision spec §2.5: 2×2 groups of consecutive rows).
    pub fn positions(&self) -> Vec<i64> {
        let mut out = Vec::with_capacity(self.patches() * 3);
        for &[t, h, w] in &self.grids {
            for ti in 0..t {
                for bh in 0..h / 2 {
                    for bw in 0..w / 2 {
                        for mh in 0..2 {
                            for mw in 0..2 {
                                out.extend([ti as i64, (2 * bh + mh) as i64, (2 * bw + mw) as i64]);
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Each patch row's last row index within its image (attention sees its own image only).
    pub fn segment_ends(&self) -> Vec<i64> {
        self.grids.iter().flat_map(|g| std::iter::repeat_n((g[0] * g[1] * g[2]) as i64 - 1, g[0] * g[1] * g[2])).collect()
    }
}

/// The bytes of an images file for `seqs`.
pub fn encode(seqs: &BTreeMap<usize, SeqImages>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for (seq, im) in seqs {
        let rows = im.patches();
        let row = im.pixels.len().checked_div(rows).unwrap_or(0);
        let grid: Vec<u8> = im.grids.iter().flat_map(|g| g.iter().flat_map(|&v| (v as i64).to_le_bytes())).collect();
        let pix: Vec<u8> = im.pixels.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (name, dtype, shape, bytes) in [
            (format!("seq{seq}.image_grid_thw"), "I64", vec![im.grids.len(), 3], grid),
            (format!("seq{seq}.pixel_values"), "F32", vec![rows, row], pix),
        ] {
            let start = data.len();
            data.extend_from_slice(&bytes);
            header.insert(name, serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}));
        }
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap_or_default();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    out
}

/// Reads an images file for rows of `patch_row` values: every sequence's
/// grid and pixels, each grid with even `h`, `w` and rows that match its
/// pixels, every value finite.
pub fn decode(bytes: &[u8], patch_row: usize) -> Result<BTreeMap<usize, SeqImages>, String> {
    let n = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).ok_or("shorter than a safetensors header")?;
    let hend = 8u64.checked_add(n).filter(|&e| e <= bytes.len() as u64).ok_or("the header length does not fit the file")? as usize;
    let tensors = parse_header(&bytes[8..hend], (bytes.len() - hend) as u64).map_err(|p| match p {
        HeaderProblem::Invalid(m) => m,
        HeaderProblem::Dtype { tensor, dtype } => format!("tensor `{tensor}` has element type {dtype}; expected F32 or I64"),
    })?;
    let data = &bytes[hend..];
    let mut grids: BTreeMap<usize, Vec<[usize; 3]>> = BTreeMap::new();
    let mut pixels: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    for t in &tensors {
        let (seq, what) = t
            .name
            .strip_prefix("seq")
            .and_then(|r| r.split_once('.'))
            .and_then(|(s, w)| Some((s.parse::<usize>().ok()?, w)))
            .ok_or_else(|| format!("unexpected tensor `{}` (expected seqN.pixel_values and seqN.image_grid_thw)", t.name))?;
        let raw = &data[t.start as usize..t.end as usize];
        match (what, t.dtype, t.shape.as_slice()) {
            ("image_grid_thw", DType::I64, [_, 3]) => {
                let v: Vec<i64> = raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
                let mut g = Vec::new();
                for c in v.chunks_exact(3) {
                    let ok = c.iter().all(|&x| (1..=1 << 20).contains(&x)) && c[1] % 2 == 0 && c[2] % 2 == 0;
                    if !ok {
                        return Err(format!("`{}`: grid {c:?} is not (t, h, w) with positive t and even h, w", t.name));
                    }
                    g.push([c[0] as usize, c[1] as usize, c[2] as usize]);
                }
                grids.insert(seq, g);
            }
            ("pixel_values", DType::F32, [_, r]) if *r == patch_row => {
                let v: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4]))).collect();
                if v.iter().any(|x| !x.is_finite()) {
                    return Err(format!("`{}` holds a value that is not finite", t.name));
                }
                pixels.insert(seq, v);
            }
            _ => {
                return Err(format!(
                    "`{}` is {} {:?}; expected image_grid_thw I64 [n, 3] or pixel_values F32 [P, {patch_row}]",
                    t.name, t.dtype, t.shape
                ))
            }
        }
    }
    let mut out = BTreeMap::new();
    for (seq, g) in grids {
        let p = pixels.remove(&seq).ok_or_else(|| format!("seq{seq} has a grid but no pixel_values"))?;
        let im = SeqImages { grids: g, pixels: p };
        let rows = im.grids.iter().try_fold(0usize, |a, g| a.checked_add(g[0].checked_mul(g[1])?.checked_mul(g[2])?)).unwrap_or(usize::MAX);
        if rows.checked_mul(patch_row) != Some(im.pixels.len()) || im.grids.is_empty() {
            return Err(format!("seq{seq}: its grids make {rows} patch rows, but pixel_values has {}", im.pixels.len() / patch_row.max(1)));
        }
        out.insert(seq, im);
    }
    if let Some(seq) = pixels.keys().next() {
        return Err(format!("seq{seq} has pixel_values but no image_grid_thw"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_orders_rows_block_major() {
        let im = SeqImages { grids: vec![[1, 2, 4]], pixels: (0..8 * 3).map(|v| v as f32).collect() };
        let seqs = BTreeMap::from([(3usize, im.clone())]);
        assert_eq!(decode(&encode(&seqs), 3).unwrap(), seqs);
        assert_eq!(im.tokens(), vec![2]);
        // Rows 0-3 are the first 2×2 group: (0,0), (0,1), (1,0), (1,1).
        assert_eq!(&im.positions()[..12], &[0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1]);
        assert_eq!(&im.positions()[12..15], &[0, 0, 2]);
        assert_eq!(im.segment_ends(), vec![7; 8]);
    }

    #[test]
    fn damage_is_an_error() {
        let im = SeqImages { grids: vec![[1, 3, 2]], pixels: vec![0.0; 6] };
        let bytes = encode(&BTreeMap::from([(0usize, im)]));
        assert!(decode(&bytes, 1).unwrap_err().contains("even"));
        let im = SeqImages { grids: vec![[1, 2, 2]], pixels: vec![0.0; 5] };
        assert!(decode(&encode(&BTreeMap::from([(0usize, im)])), 1).is_err());
        assert!(decode(b"abc", 1).is_err());
        let im = SeqImages { grids: vec![[1, 2, 2]], pixels: vec![f32::NAN; 4] };
        assert!(decode(&encode(&BTreeMap::from([(0usize, im)])), 1).unwrap_err().contains("finite"));
    }
}
