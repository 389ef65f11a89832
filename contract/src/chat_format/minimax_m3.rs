//! MiniMax-M3's chat format (`../shared/spec/minimax-m3-chat.md`): reasoning
//! in `<mm:think>…</mm:think>`, tool calls as `<invoke>` tags behind the
//! `]<]minimax[>[` mark, images and video frames between its bracketed
//! special tokens.

use super::{ChatFormat, MediaTokens, ThinkTags, ToolMarkup};

pub(super) const FORMAT: ChatFormat = ChatFormat {
    family: "minimax_m3",
    architectures: &["MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM", "MiniMaxM3VLForCausalLM"],
    parsers: &["minimax_m3"],
    think: ThinkTags { open: "<mm:think>", close: "</mm:think>" },
    tools: ToolMarkup { mark: "]<]minimax[>[", block: "tool_call", invoke: "invoke", item: "item" },
    media: MediaTokens {
        start_of_image: "]<]start of image[>[",
        end_of_image: "]<]end of image[>[",
        video: "]<]video[>[",
        frame_time: ["]<]", " seconds[>["],
    },
};
