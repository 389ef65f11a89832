//! Images in a prompt: each image's placeholder expanded as the reference
//! processor expands it (`]<]start of image[>[` + `]<]image[>[` × its
//! tokens + `]<]end of image[>[`), or, for prompts given as ids, the runs
//! already there checked against the images; and the images file the stage
//! that encodes them reads (`m3c_contract::images`).

use super::processor::{self, Processed};
use m3c_contract::images::SeqImages;
use std::path::Path;
use thiserror::Error;

/// The tokens' spelling in MiniMax-M3's tokenizer (vision spec §3).
pub const START_OF_IMAGE: &str = "]<]start of image[>[";
pub const END_OF_IMAGE: &str = "]<]end of image[>[";
/// The largest image file m3c reads.
pub const MAX_IMAGE_BYTES: u64 = 64 << 20;

#[derive(Debug, Error, PartialEq)]
pub enum PromptImageError {
    #[error("the prompt has {found} image placeholder(s) but {images} image(s) were given")]
    Count { found: usize, images: usize },
    #[error("image {index} ({what}) takes {expected} placeholder tokens (id {token}), but its run in the prompt has {found}")]
    Run { index: usize, what: String, expected: usize, found: usize, token: u32 },
    #[error("the tokenizer has no `{0}` token, which image prompts need")]
    NoToken(&'static str),
    #[error("images need a checkpoint with a vision tower (its config.json has no vision_config)")]
    NoVision,
}

/// The ids of the image brackets and placeholder.
#[derive(Debug, Clone, Copy)]
pub struct ImageTokens {
    pub start: u32,
    pub image: u32,
    pub end: u32,
}

impl ImageTokens {
    /// Looks the brackets up in the tokenizer; the placeholder is the config's.
    pub fn new(tok: &crate::text::TextTokenizer, image_token: usize) -> Result<ImageTokens, PromptImageError> {
        let id = |t: &'static str| tok.token_id(t).ok_or(PromptImageError::NoToken(t));
        Ok(ImageTokens { start: id(START_OF_IMAGE)?, image: image_token as u32, end: id(END_OF_IMAGE)? })
    }

    /// Replaces the k-th placeholder of `ids` (as the chat template writes
    /// one per image) with image k's bracketed run.
    pub fn expand(&self, ids: &[u32], tokens: &[usize]) -> Result<Vec<u32>, PromptImageError> {
        let found = ids.iter().filter(|&&i| i == self.image).count();
        if found != tokens.len() {
            return Err(PromptImageError::Count { found, images: tokens.len() });
        }
        let mut out = Vec::with_capacity(ids.len() + tokens.iter().map(|n| n + 1).sum::<usize>());
        let mut k = 0;
        for &id in ids {
            if id == self.image {
                out.push(self.start);
                out.extend(std::iter::repeat_n(self.image, tokens[k]));
                out.push(self.end);
                k += 1;
            } else {
                out.push(id);
            }
        }
        Ok(out)
    }

    /// Checks ids that already hold one placeholder run per image, in order:
    /// each run as long as its image's tokens.
    pub fn check_runs(&self, ids: &[i64], tokens: &[usize], names: &[String]) -> Result<(), PromptImageError> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            if ids[i] == self.image as i64 {
                let s = i;
                while i < ids.len() && ids[i] == self.image as i64 {
                    i += 1;
                }
                runs.push(i - s);
            } else {
                i += 1;
            }
        }
        if runs.len() != tokens.len() {
            return Err(PromptImageError::Count { found: runs.len(), images: tokens.len() });
        }
        for (index, (&found, &expected)) in runs.iter().zip(tokens).enumerate() {
            if found != expected {
                let what = names.get(index).cloned().unwrap_or_default();
                return Err(PromptImageError::Run { index, what, expected, found, token: self.image });
            }
        }
        Ok(())
    }
}

/// Reads and processes image files (`--image`), each error naming its file.
pub fn load(files: &[std::path::PathBuf]) -> anyhow::Result<Vec<Processed>> {
    files
        .iter()
        .map(|f| {
            let bytes = m3c_contract::input::read_bytes(f, "--image", MAX_IMAGE_BYTES)?;
            Ok(processor::process(&bytes, &f.display().to_string())?)
        })
        .collect()
}

/// One sequence's images as the stage takes them.
pub fn seq_images(images: &[Processed]) -> SeqImages {
    SeqImages {
        grids: images.iter().map(|p| p.grid).collect(),
        pixels: images.iter().flat_map(|p| p.pixel_values.iter().copied()).collect(),
    }
}

/// Writes the images file for `seqs` at `path` (a private temporary file
/// the caller owns).
pub fn write_images_file(path: &Path, seqs: &std::collections::BTreeMap<usize, SeqImages>) -> std::io::Result<()> {
    std::fs::write(path, m3c_contract::images::encode(seqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_and_runs() {
        let t = ImageTokens { start: 7, image: 5, end: 8 };
        assert_eq!(t.expand(&[1, 5, 2, 5], &[2, 1]).unwrap(), vec![1, 7, 5, 5, 8, 2, 7, 5, 8]);
        assert_eq!(t.expand(&[1, 5], &[2, 1]), Err(PromptImageError::Count { found: 1, images: 2 }));
        assert!(t.check_runs(&[1, 7, 5, 5, 8, 7, 5, 8], &[2, 1], &[]).is_ok());
        let e = t.check_runs(&[1, 5, 5, 5, 2], &[2], &["a.png".into()]).unwrap_err();
        assert!(e.to_string().contains("takes 2 placeholder tokens"), "{e}");
    }
}
