//! Where a MiniMax-M3 chat's output starts relative to the model's
//! reasoning (`../shared/spec/minimax-m3-chat.md` §4), and the cap on that
//! reasoning: the format both the front and the last stage read.
//!
//! The chat template leaves the generation prompt in one of three states,
//! set by `thinking_mode`:
//!
//! - `enabled`: the prompt ends with `<mm:think>`, so the output starts as
//!   reasoning and content follows the first `</mm:think>`
//!   ([`ThinkStart::Open`]);
//! - `disabled`: the prompt ends with `</mm:think>`, so the whole output is
//!   content ([`ThinkStart::Closed`]);
//! - `adaptive` (the default): the prompt ends with neither; the model may
//!   open with `<mm:think>…</mm:think>` or a bare `</mm:think>`, and
//!   content is what follows ([`ThinkStart::Adaptive`]).
//!
//! The output reader, the grammar that constrains a chat's content and the
//! stage that enforces a reasoning budget all follow this one rule
//! (`m3c_constrain::thinking` implements it).

use crate::chat_format::ThinkTags;

/// Where the output starts, read from the end of the rendered prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkStart {
    /// Inside an open reasoning block (`thinking_mode: enabled`).
    Open,
    /// After a closed one: everything is content (`disabled`).
    Closed,
    /// Before the model decides (`adaptive`, or a template without modes).
    Adaptive,
}

impl ThinkStart {
    /// From the text of a rendered chat prompt (trailing whitespace aside),
    /// whose reasoning is tagged with `tags`.
    pub fn of_prompt(rendered: &str, tags: &ThinkTags) -> ThinkStart {
        let t = rendered.trim_end();
        if t.ends_with(tags.close) {
            ThinkStart::Closed
        } else if t.ends_with(tags.open) {
            ThinkStart::Open
        } else {
            ThinkStart::Adaptive
        }
    }

    /// The word of the `think=` field.
    pub fn name(self) -> &'static str {
        match self {
            ThinkStart::Open => "open",
            ThinkStart::Closed => "closed",
            ThinkStart::Adaptive => "adaptive",
        }
    }

    pub fn parse(word: &str) -> Result<ThinkStart, String> {
        match word {
            "open" => Ok(ThinkStart::Open),
            "closed" => Ok(ThinkStart::Closed),
            "adaptive" => Ok(ThinkStart::Adaptive),
            _ => Err(format!("think `{word}`: expected open, closed or adaptive")),
        }
    }
}

/// A sequence's reasoning cap: after `budget` tokens of reasoning the
/// sampler draws the closing tag (vLLM's `thinking_token_budget`), so content,
/// and a constrained answer, always gets its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkBudget {
    pub start: ThinkStart,
    pub budget: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_end_says_where_the_output_starts() {
        let tags = &crate::chat_format::ChatFormat::of_family("minimax_m3").unwrap().think;
        assert_eq!(ThinkStart::of_prompt("]~b]ai\n<mm:think>", tags), ThinkStart::Open);
        assert_eq!(ThinkStart::of_prompt("]~b]ai\n</mm:think>\n", tags), ThinkStart::Closed);
        assert_eq!(ThinkStart::of_prompt("]~b]ai\n", tags), ThinkStart::Adaptive);
        for s in [ThinkStart::Open, ThinkStart::Closed, ThinkStart::Adaptive] {
            assert_eq!(ThinkStart::parse(s.name()), Ok(s));
        }
        assert!(ThinkStart::parse("maybe").unwrap_err().contains("open, closed or adaptive"));
    }
}
