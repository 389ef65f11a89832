//! Videos in: decoded with FFmpeg's libraries (through the `ffmpeg-next`
//! crate), sampled, resized and laid out as transformers 5.24's
//! `MiniMaxM3VLVideoProcessor` does when it samples frames itself
//! (`do_sample_frames=True`, its default 1 fps, from the stream's metadata)
//! and resizes them (`do_resize=True`, its video bounds); and the prompt
//! text `MiniMaxM3VLProcessor` puts where the video's token was.
//!
//! Why FFmpeg: no pure-Rust decoder reads the videos users send. Cisco's
//! OpenH264 (the `openh264` crate, the only maintained H.264 decoder in a
//! crate) decodes the constrained baseline profile only: on a High-profile
//! clip with B-frames, as phones and the web encode, it failed from the
//! first B-slice on (checked here on `tests/fixtures/video/clip.mp4`). FFmpeg
//! reads H.264, HEVC, VP8/9 and AV1 in MP4, WebM and Matroska, is what
//! transformers' PyAV and vLLM's OpenCV readers decode with, and its
//! `rgb24` conversion gives the same bytes as PyAV's (checked on the
//! fixture: every pixel of every frame equal).
//!
//! The steps (`../shared/spec/minimax-m3-vision.md` §8):
//! - frames sampled as `default_sample_indices_fn` samples them: n =
//!   max(1, ⌊total / fps_video · 1⌋) frames at indices ⌊i · total / n⌋;
//! - each frame resized to `smart_resize(h, w)` with the video's bounds
//!   (4·28·28 to 768·28·28 pixels), with the image path's torchvision resize;
//! - normalised as images, padded to an even count with the last frame,
//!   patch rows per temporal pair of frames;
//! - the grid cut into chunks of at most 4 temporal patches (each its own
//!   attention segment, temporal positions restarting at 0);
//! - in the text, per temporal patch τ: `]<]{s:.1f} seconds[>[` (s = the
//!   index of frame 2τ / fps_video), the image brackets around `]<]video[>[`
//!   × (h·w / 784).

use super::processor::{self, ImageError, Rgb, PATCH, TEMPORAL};
use m3c_contract::chat_format::MediaTokens;
use std::path::Path;
use thiserror::Error;

/// Temporal patches per attention segment (the processor's
/// `vision_segment_max_frames`).
pub const SEGMENT_MAX_PATCHES: usize = 4;
/// The largest video file m3c reads.
pub const MAX_VIDEO_BYTES: u64 = 512 << 20;

/// What a video may be, and how it is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoLimits {
    /// Frames sampled per second of video (the processor's `fps`).
    pub fps: f64,
    /// The most frames sampled; longer videos are sampled this many times,
    /// evenly (the processor's `max_frames`).
    pub max_frames: usize,
    /// Pixels per frame after resizing (the processor's `min_pixels`,
    /// `max_pixels`).
    pub min_pixels: usize,
    pub max_pixels: usize,
    /// Pixels of all sampled frames together, after resizing (the
    /// processor's `total_pixels`): a video past it is refused.
    pub total_pixels: usize,
    /// The longest video, in seconds.
    pub max_seconds: f64,
    /// The largest decoded frame, in pixels.
    pub max_frame_pixels: usize,
}

impl Default for VideoLimits {
    fn default() -> Self {
        VideoLimits {
            fps: 1.0,
            max_frames: 768,
            min_pixels: 4 * 28 * 28,
            max_pixels: 768 * 28 * 28,
            total_pixels: 64000 * 28 * 28 * 9 / 10,
            max_seconds: 3600.0,
            max_frame_pixels: 8192 * 8192,
        }
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum VideoError {
    #[error("{what}: not a video m3c can read: {why}")]
    Decode { what: String, why: String },
    #[error("{what}: the video has no frames")]
    Empty { what: String },
    #[error("{what}: {seconds:.1} s of video; the most m3c takes is {max:.0} s")]
    TooLong { what: String, seconds: f64, max: f64 },
    #[error("{what}: frames of {w}×{h} pixels; the largest m3c decodes is {max} pixels")]
    FrameTooLarge { what: String, w: usize, h: usize, max: usize },
    #[error("{what}: frame {index} is {w}×{h}, but the first is {w0}×{h0}: a video's frames must share one size")]
    SizeChanged { what: String, index: usize, w: usize, h: usize, w0: usize, h0: usize },
    #[error("{what}: {frames} sampled frames of {h}×{w} are {total} pixels; the most one video may take is {max} (about {tokens} tokens)")]
    TooManyPixels { what: String, frames: usize, h: usize, w: usize, total: usize, max: usize, tokens: usize },
    #[error("{what}: the stream says {claimed} frames but only {decoded} could be decoded")]
    Truncated { what: String, claimed: usize, decoded: usize },
    #[error(transparent)]
    Frame(#[from] ImageError),
}

/// A video as the tower takes it, and what its prompt text needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Video {
    /// `[Σ t·h·w, ROW]` f32 patch rows, chunk after chunk.
    pub pixel_values: Vec<f32>,
    /// Each chunk's (t, h, w) patch grid: at most 4 temporal patches each.
    pub grids: Vec<[usize; 3]>,
    /// Each temporal patch's time in seconds (its first frame's).
    pub timestamps: Vec<f64>,
    /// The sampled frames' indices in the stream, and the stream's frame rate.
    pub frames: Vec<usize>,
    pub fps: f64,
}

impl Video {
    /// Placeholder tokens per temporal patch (one per 2×2 merge group).
    pub fn tokens_per_patch(&self) -> usize {
        self.grids.first().map_or(0, |g| g[1] * g[2] / 4)
    }

    /// Placeholder tokens of the whole video.
    pub fn tokens(&self) -> usize {
        self.timestamps.len() * self.tokens_per_patch()
    }

    /// The text the reference processor writes in place of the video's
    /// token: per temporal patch, its time and its bracketed placeholders.
    pub fn prompt_text(&self, media: &MediaTokens) -> String {
        let run = media.video.repeat(self.tokens_per_patch());
        let [before, after] = media.frame_time;
        self.timestamps.iter().map(|s| format!("{before}{s:.1}{after}{}{run}{}", media.start_of_image, media.end_of_image)).collect()
    }
}

/// Python's `int(x)` of a non-negative float, as a count.
fn floor_count(x: f64) -> usize {
    if x.is_finite() && x > 0.0 {
        x as usize
    } else {
        0
    }
}

/// The frames `default_sample_indices_fn` takes from `total` frames at
/// `video_fps`, sampling `fps` per second; at most `max_frames`.
pub fn sample_indices(total: usize, video_fps: f64, fps: f64, max_frames: usize) -> Vec<usize> {
    let n = floor_count(total as f64 / video_fps * fps).max(1).min(max_frames.max(1)).min(total.max(1));
    (0..n).map(|i| i * total / n).collect()
}

/// The reference processor on sampled RGB frames (stream indices `frames`
/// of a stream at `fps`).
pub fn process_frames(rgb: &[Rgb], frames: &[usize], fps: f64, limits: &VideoLimits, what: &str) -> Result<Video, VideoError> {
    let first = rgb.first().ok_or_else(|| VideoError::Empty { what: what.into() })?;
    let (h0, w0) = (first.h, first.w);
    if let Some((index, f)) = rgb.iter().enumerate().find(|(_, f)| (f.h, f.w) != (h0, w0)) {
        return Err(VideoError::SizeChanged { what: what.into(), index: frames[index], w: f.w, h: f.h, w0, h0 });
    }
    let (rh, rw) = processor::smart_resize_within(h0, w0, limits.min_pixels, limits.max_pixels, what)?;
    let padded = rgb.len().div_ceil(TEMPORAL) * TEMPORAL;
    let total = padded * rh * rw;
    if total > limits.total_pixels {
        let tokens = total / (TEMPORAL * 28 * 28);
        return Err(VideoError::TooManyPixels {
            what: what.into(),
            frames: rgb.len(),
            h: rh,
            w: rw,
            total,
            max: limits.total_pixels,
            tokens,
        });
    }
    let resized: Vec<Vec<u8>> = rgb
        .iter()
        .map(|f| {
            let chw = processor::to_chw(f);
            if (rh, rw) == (h0, w0) {
                chw
            } else {
                processor::resize_chw(&chw, h0, w0, rh, rw)
            }
        })
        .collect();
    let mut refs: Vec<&[u8]> = resized.iter().map(Vec::as_slice).collect();
    while refs.len() < padded {
        refs.push(refs[refs.len() - 1]);
    }
    let pixel_values = processor::patchify_frames(&refs, rh, rw);
    let (gt, gh, gw) = (padded / TEMPORAL, rh / PATCH, rw / PATCH);
    let grids = (0..gt).step_by(SEGMENT_MAX_PATCHES).map(|s| [SEGMENT_MAX_PATCHES.min(gt - s), gh, gw]).collect();
    let timestamps = (0..gt).map(|t| frames[(t * TEMPORAL).min(frames.len() - 1)] as f64 / fps).collect();
    Ok(Video { pixel_values, grids, timestamps, frames: frames.to_vec(), fps })
}

/// Decodes the video file at `path` and keeps the frames the processor
/// samples: their RGB, their indices in the stream, and its frame rate.
pub fn sampled_frames(path: &Path, limits: &VideoLimits, what: &str) -> Result<(Vec<Rgb>, Vec<usize>, f64), VideoError> {
    decode::sampled(path, limits, what)
}

/// Decodes, samples and processes the video file at `path`.
pub fn process_file(path: &Path, limits: &VideoLimits, what: &str) -> Result<Video, VideoError> {
    let (rgb, frames, fps) = decode::sampled(path, limits, what)?;
    process_frames(&rgb, &frames, fps, limits, what)
}

/// Decodes, samples and processes a video file's bytes (through a private
/// temporary file, which FFmpeg's readers need to seek in).
pub fn process_bytes(bytes: &[u8], limits: &VideoLimits, what: &str) -> Result<Video, VideoError> {
    let io = |e: std::io::Error| VideoError::Decode { what: what.into(), why: format!("a temporary file: {e}") };
    let mut file = tempfile::NamedTempFile::new().map_err(io)?;
    std::io::Write::write_all(&mut file, bytes).map_err(io)?;
    process_file(file.path(), limits, what)
}

/// Replaces the k-th video token of `text` with video k's prompt text (as
/// the reference processor does, before tokenizing: its first timestamp
/// is tokenized with the text before it).
pub fn expand_text(text: &str, videos: &[Video], media: &MediaTokens) -> Result<String, super::prompt::PromptImageError> {
    let found = text.matches(media.video).count();
    if found != videos.len() {
        return Err(super::prompt::PromptImageError::VideoCount { found, videos: videos.len(), token: format!("`{}`", media.video) });
    }
    let mut out = String::with_capacity(text.len() + videos.iter().map(|v| v.tokens() * 16).sum::<usize>());
    let mut parts = text.split(media.video);
    out.push_str(parts.next().unwrap_or_default());
    for (v, rest) in videos.iter().zip(parts) {
        out.push_str(&v.prompt_text(media));
        out.push_str(rest);
    }
    Ok(out)
}

mod decode {
    //! FFmpeg's side: open, find the video stream, decode in display
    //! order, keep the sampled frames as RGB.
    use super::{sample_indices, VideoError, VideoLimits};
    use crate::vision::processor::Rgb;
    use ffmpeg_next as ff;
    use std::path::Path;

    fn init() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // Registration cannot fail on the FFmpeg versions the crate
            // supports; its warnings on damaged input would only reach
            // stderr, so they are silenced: errors come back as values.
            let _ = ff::init();
            ff::util::log::set_level(ff::util::log::Level::Quiet);
        });
    }

    /// The stream's frame rate (PyAV's `average_rate`, else its base rate).
    fn frame_rate(st: &ff::format::stream::Stream) -> Option<f64> {
        [st.avg_frame_rate(), st.rate()]
            .into_iter()
            .map(|r| r.numerator() as f64 / r.denominator() as f64)
            .find(|f| f.is_finite() && *f > 0.0)
    }

    /// Frames in the stream: the container's count, else its packets.
    fn frame_count(path: &Path, index: usize, claimed: i64, what: &str) -> Result<usize, VideoError> {
        if claimed > 0 {
            return Ok(claimed as usize);
        }
        let bad = |e: ff::Error| VideoError::Decode { what: what.into(), why: e.to_string() };
        let mut ictx = ff::format::input(path).map_err(bad)?;
        Ok(ictx.packets().filter(|(s, _)| s.index() == index).count())
    }

    /// The sampled frames as RGB, their indices, and the stream's rate.
    pub(super) fn sampled(path: &Path, limits: &VideoLimits, what: &str) -> Result<(Vec<Rgb>, Vec<usize>, f64), VideoError> {
        init();
        let bad = |e: ff::Error| VideoError::Decode { what: what.into(), why: e.to_string() };
        let mut ictx = ff::format::input(path).map_err(bad)?;
        let st = ictx
            .streams()
            .best(ff::media::Type::Video)
            .ok_or_else(|| VideoError::Decode { what: what.into(), why: "no video stream".into() })?;
        let index = st.index();
        let fps = frame_rate(&st).ok_or_else(|| VideoError::Decode { what: what.into(), why: "the stream gives no frame rate".into() })?;
        let claimed = st.frames();
        let mut decoder = ff::codec::context::Context::from_parameters(st.parameters()).and_then(|c| c.decoder().video()).map_err(bad)?;
        let (w, h) = (decoder.width() as usize, decoder.height() as usize);
        if w * h > limits.max_frame_pixels {
            return Err(VideoError::FrameTooLarge { what: what.into(), w, h, max: limits.max_frame_pixels });
        }
        let total = frame_count(path, index, claimed, what)?;
        if total == 0 {
            return Err(VideoError::Empty { what: what.into() });
        }
        let seconds = total as f64 / fps;
        if seconds > limits.max_seconds {
            return Err(VideoError::TooLong { what: what.into(), seconds, max: limits.max_seconds });
        }
        let want = sample_indices(total, fps, limits.fps, limits.max_frames);
        let mut keep = Keep { want: &want, next: 0, seen: 0, out: Vec::with_capacity(want.len()), scaler: None, limits, what };
        for (s, packet) in ictx.packets() {
            if s.index() != index {
                continue;
            }
            decoder.send_packet(&packet).map_err(bad)?;
            keep.drain(&mut decoder)?;
            if keep.done() {
                break;
            }
        }
        if !keep.done() {
            decoder.send_eof().map_err(bad)?;
            keep.drain(&mut decoder)?;
        }
        if !keep.done() {
            return Err(VideoError::Truncated { what: what.into(), claimed: total, decoded: keep.seen });
        }
        Ok((keep.out, want, fps))
    }

    /// The frames decoded so far, and the RGB of those sampled.
    struct Keep<'a> {
        want: &'a [usize],
        next: usize,
        seen: usize,
        out: Vec<Rgb>,
        scaler: Option<(ff::software::scaling::Context, (ff::format::Pixel, u32, u32))>,
        limits: &'a VideoLimits,
        what: &'a str,
    }

    impl Keep<'_> {
        fn done(&self) -> bool {
            self.next == self.want.len()
        }

        /// Takes every frame the decoder has ready.
        fn drain(&mut self, decoder: &mut ff::decoder::Video) -> Result<(), VideoError> {
            let mut frame = ff::frame::Video::empty();
            while decoder.receive_frame(&mut frame).is_ok() {
                if !self.done() && self.want[self.next] == self.seen {
                    let rgb = self.rgb(&frame)?;
                    // An index repeats when fewer frames exist than are sampled.
                    while !self.done() && self.want[self.next] == self.seen {
                        self.out.push(rgb.clone());
                        self.next += 1;
                    }
                }
                self.seen += 1;
            }
            Ok(())
        }

        /// One decoded frame as RGB24 (swscale, as PyAV's `rgb24`).
        fn rgb(&mut self, frame: &ff::frame::Video) -> Result<Rgb, VideoError> {
            let key = (frame.format(), frame.width(), frame.height());
            let (w, h) = (key.1 as usize, key.2 as usize);
            if w * h > self.limits.max_frame_pixels || w == 0 || h == 0 {
                return Err(VideoError::FrameTooLarge { what: self.what.into(), w, h, max: self.limits.max_frame_pixels });
            }
            if self.scaler.as_ref().is_none_or(|(_, k)| *k != key) {
                let flags = ff::software::scaling::Flags::BILINEAR;
                let ctx = ff::software::scaling::Context::get(key.0, key.1, key.2, ff::format::Pixel::RGB24, key.1, key.2, flags)
                    .map_err(|e| VideoError::Decode { what: self.what.into(), why: format!("converting frames to RGB: {e}") })?;
                self.scaler = Some((ctx, key));
            }
            let mut out = ff::frame::Video::empty();
            let (scaler, _) = self.scaler.as_mut().expect("set above");
            scaler
                .run(frame, &mut out)
                .map_err(|e| VideoError::Decode { what: self.what.into(), why: format!("converting frames to RGB: {e}") })?;
            let stride = out.stride(0);
            let data = out.data(0);
            let mut rgb = Vec::with_capacity(w * h * 3);
            for row in 0..h {
                rgb.extend_from_slice(&data[row * stride..row * stride + 3 * w]);
            }
            Ok(Rgb { h, w, data: rgb })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_is_the_references() {
        // 36 frames at 4 fps, 1 fps: 9 frames, every 4th.
        assert_eq!(sample_indices(36, 4.0, 1.0, 768), vec![0, 4, 8, 12, 16, 20, 24, 28, 32]);
        // int(10/30) = 0 → one frame.
        assert_eq!(sample_indices(10, 30.0, 1.0, 768), vec![0]);
        // 100 s at 1 fps, capped at 8 frames: evenly.
        assert_eq!(sample_indices(3000, 30.0, 1.0, 8), vec![0, 375, 750, 1125, 1500, 1875, 2250, 2625]);
    }

    #[test]
    fn timestamps_print_as_pythons_format() {
        // Python: f"{0.25:.1f}" = '0.2', f"{0.35:.1f}" = '0.3', f"{0.75:.1f}" = '0.8', f"{2.45:.1f}" = '2.5'.
        for (x, s) in [(0.25, "0.2"), (0.35, "0.3"), (0.75, "0.8"), (2.45, "2.5"), (8.0, "8.0"), (1.0 / 3.0, "0.3")] {
            assert_eq!(format!("{x:.1}"), s, "{x}");
        }
    }

    #[test]
    fn frames_pad_to_pairs_and_chunk_by_four() {
        let f = |v: u8| Rgb { h: 56, w: 56, data: vec![v; 56 * 56 * 3] };
        let rgb: Vec<Rgb> = (0..9).map(|i| f(i * 20)).collect();
        let frames: Vec<usize> = (0..9).map(|i| i * 4).collect();
        let v = process_frames(&rgb, &frames, 4.0, &VideoLimits::default(), "t").unwrap();
        assert_eq!(v.grids, vec![[4, 4, 4], [1, 4, 4]]);
        assert_eq!(v.timestamps, vec![0.0, 2.0, 4.0, 6.0, 8.0]);
        assert_eq!(v.tokens(), 20);
        // The last pair repeats frame 8: both halves of its rows are equal.
        let row = &v.pixel_values[v.pixel_values.len() - processor::ROW..];
        assert_eq!(row[..196], row[196..392]);
        let media = &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().media;
        let text = v.prompt_text(media);
        assert!(text.starts_with("]<]0.0 seconds[>[]<]start of image[>[]<]video[>["), "{text}");
        assert_eq!(text.matches("]<]video[>[").count(), 20);
        let e = process_frames(&[f(0), Rgb { h: 28, w: 56, data: vec![0; 28 * 56 * 3] }], &[0, 1], 1.0, &VideoLimits::default(), "v.mp4");
        assert!(matches!(e, Err(VideoError::SizeChanged { .. })), "{e:?}");
        let small = VideoLimits { total_pixels: 56 * 56 * 4, ..VideoLimits::default() };
        let e = process_frames(&rgb, &frames, 4.0, &small, "v.mp4").unwrap_err();
        assert!(e.to_string().contains("v.mp4: 9 sampled frames of 56×56"), "{e}");
    }
}
