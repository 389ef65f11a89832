//! Images in a prompt: each image's placeholder expanded as the reference
//! processor expands it (the family's start-of-image token, MiniMax-M3's
//! `]<]start of image[>[`, + `]<]image[>[` × its tokens + its end token), or, for prompts given as ids, the runs
//! already there checked against the images; and the images file the stage
//! that encodes them reads (`m3c_contract::images`).

use super::processor::{self, Processed};
use m3c_contract::chat_format::MediaTokens;
use m3c_contract::images::SeqImages;
use std::path::Path;
use thiserror::Error;

/// The largest image file m3c reads.
pub const MAX_IMAGE_BYTES: u64 = 64 << 20;

#[derive(Debug, Error, PartialEq)]
pub enum PromptImageError {
    #[error("the prompt has {found} image placeholder(s) but {images} image(s) were given")]
    Count { found: usize, images: usize },
    #[error("image {index} ({what}) takes {expected} placeholder tokens (id {token}), but its run in the prompt has {found}")]
    Run { index: usize, what: String, expected: usize, found: usize, token: u32 },
    /// `token`: the placeholder as the prompt has it (its text, or its id).
    #[error("the prompt has {found} video placeholder(s) ({token}) but {videos} video(s) were given")]
    VideoCount { found: usize, videos: usize, token: String },
    #[error("the prompt ends an {what}'s placeholders early: {left} more were expected before any other placeholder or the end")]
    Interleaved { what: &'static str, left: usize },
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
    /// Looks the family's brackets (`media`) up with `token_id` (the
    /// tokenizer's); the placeholder is the config's.
    pub fn new(
        token_id: impl Fn(&str) -> Option<u32>,
        image_token: usize,
        media: &'static MediaTokens,
    ) -> Result<ImageTokens, PromptImageError> {
        let id = |t: &'static str| token_id(t).ok_or(PromptImageError::NoToken(t));
        Ok(ImageTokens { start: id(media.start_of_image)?, image: image_token as u32, end: id(media.end_of_image)? })
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

/// Reads and processes video files (`--video`), each error naming its file.
pub fn load_videos(files: &[std::path::PathBuf]) -> anyhow::Result<Vec<super::video::Video>> {
    files
        .iter()
        .map(|f| {
            let size = m3c_contract::input::regular_file(f, "--video")?;
            if size > super::video::MAX_VIDEO_BYTES {
                anyhow::bail!(
                    "--video {}: {size} bytes; the largest video m3c reads is {} bytes",
                    f.display(),
                    super::video::MAX_VIDEO_BYTES
                );
            }
            Ok(super::video::process_file(f, &super::video::VideoLimits::default(), &f.display().to_string())?)
        })
        .collect()
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

/// An image or a video of a prompt, processed.
#[derive(Debug, Clone, PartialEq)]
pub enum Media {
    Image(Processed),
    Video(super::video::Video),
}

/// One sequence's images and videos as the stage takes them, in prompt
/// order: each image one grid, each video one grid per chunk. The stage
/// gives the rows of all of them, in this order, to the placeholders of
/// either kind in the prompt's order.
pub fn seq_media(media: &[Media]) -> SeqImages {
    let mut out = SeqImages { grids: Vec::new(), pixels: Vec::new() };
    for m in media {
        match m {
            Media::Image(p) => {
                out.grids.push(p.grid);
                out.pixels.extend_from_slice(&p.pixel_values);
            }
            Media::Video(v) => {
                out.grids.extend_from_slice(&v.grids);
                out.pixels.extend_from_slice(&v.pixel_values);
            }
        }
    }
    out
}

/// One sequence's images and videos in the order their placeholders take
/// in `ids` (whatever order a raw prompt wrote them in): walking the ids,
/// each placeholder that starts an item takes the next image or video of
/// its kind, which then owns its next `tokens()` placeholders of that kind.
pub fn seq_media_in_order(
    ids: &[u32],
    image_token: u32,
    video_token: u32,
    images: Vec<Processed>,
    videos: Vec<super::video::Video>,
) -> Result<SeqImages, PromptImageError> {
    let (n_images, n_videos) = (images.len(), videos.len());
    let (mut images, mut videos) = (images.into_iter(), videos.into_iter());
    let mut ordered = Vec::with_capacity(n_images + n_videos);
    // The kind of the item being filled and the placeholders it still owns.
    let mut open: Option<(u32, usize)> = None;
    for &id in ids.iter().filter(|&&id| id == image_token || id == video_token) {
        match open {
            Some((kind, left)) if kind == id && left > 0 => open = Some((kind, left - 1)),
            Some((kind, left)) if left > 0 => {
                let what = if kind == image_token { "image" } else { "video" };
                return Err(PromptImageError::Interleaved { what, left });
            }
            _ => {
                let item = if id == image_token { images.next().map(Media::Image) } else { videos.next().map(Media::Video) };
                let Some(item) = item else {
                    let found = ids.iter().filter(|&&i| i == id).count();
                    return Err(if id == image_token {
                        PromptImageError::Count { found, images: n_images }
                    } else {
                        PromptImageError::VideoCount { found, videos: n_videos, token: format!("id {video_token}") }
                    });
                };
                let tokens = match &item {
                    Media::Image(p) => p.tokens(),
                    Media::Video(v) => v.tokens(),
                };
                open = Some((id, tokens.saturating_sub(1)));
                ordered.push(item);
            }
        }
    }
    let found = |t: u32| ids.iter().filter(|&&i| i == t).count();
    if images.next().is_some() {
        return Err(PromptImageError::Count { found: found(image_token), images: n_images });
    }
    if videos.next().is_some() {
        return Err(PromptImageError::VideoCount { found: found(video_token), videos: n_videos, token: format!("id {video_token}") });
    }
    if let Some((kind, left @ 1..)) = open {
        let what = if kind == image_token { "image" } else { "video" };
        return Err(PromptImageError::Interleaved { what, left });
    }
    Ok(seq_media(&ordered))
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
