//! The lexemes of a family's call markup (`ToolMarkup`) as text arrives in
//! pieces: the mark (MiniMax-M3's `]<]minimax[>[`), opening and closing
//! tags, and the text between.
//! What may still become a mark or a tag is held back until the next piece
//! shows what it is, so a reader never acts on half a tag, and text that
//! cannot be one goes out at once.

use m3c_contract::chat_format::ToolMarkup;

// The mark is what the model writes before every tag of a call block (one
// token). Readers drop it wherever it appears, as the spec's parsers do,
// but a tag behind it is certainly markup.

/// The longest tag name read; a longer `<...` is text.
const MAX_NAME: usize = 128;
/// The longest attribute text of `<invoke ...>`.
const MAX_ATTRS: usize = 512;

/// One lexeme at the start of the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lexeme<'a> {
    /// Text up to the next thing that may be a mark or a tag.
    Text(&'a str),
    Mark,
    /// `<name>`, or `<invoke name="...">` (`attrs`: what follows the name).
    Open {
        name: &'a str,
        attrs: &'a str,
    },
    /// `</name>`.
    Close(&'a str),
}

/// Which tags the reader looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tags {
    /// Only the tags that open or close a call block (`tool_call`,
    /// `invoke`): anything else is text, so prose streams without delay.
    Block,
    /// Any tag (inside a call, where parameters are tags).
    Any,
}

/// The first lexeme of `s` and its length in bytes, or `None` when `s`
/// may continue into a mark or tag that is not whole yet (never at the
/// `end` of the output, when everything is decided). `after_mark`: a mark
/// came just before, so `invoke name=...>`, `/invoke>`, `tool_call>` and
/// `/tool_call>` are tags even without their `<` (real MiniMax-M3 output
/// drops it now and then).
pub fn next<'a>(s: &'a str, m: &ToolMarkup, tags: Tags, after_mark: bool, end: bool) -> Option<(Lexeme<'a>, usize)> {
    if s.is_empty() {
        return None;
    }
    if after_mark {
        match tag(s, m, 0, Tags::Block, false, end) {
            Found::Tag(l, n) => return Some((l, n)),
            Found::More => return None,
            Found::No => {}
        }
    }
    // Text up to the first position where a mark or a tag may start.
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        let stop = if m.mark.chars().next().is_some_and(|c| rest.starts_with(c)) {
            if rest.starts_with(m.mark) {
                Stop::Here
            } else if !end && m.mark.starts_with(rest) {
                Stop::More
            } else {
                Stop::Go
            }
        } else if rest.starts_with('<') {
            match tag(s, m, i, tags, true, end) {
                Found::Tag(..) => Stop::Here,
                Found::More => Stop::More,
                Found::No => Stop::Go,
            }
        } else {
            Stop::Go
        };
        match stop {
            Stop::Go => i += rest.chars().next().map_or(1, char::len_utf8),
            Stop::Here if i > 0 => return Some((Lexeme::Text(&s[..i]), i)),
            Stop::More if i > 0 => return Some((Lexeme::Text(&s[..i]), i)),
            Stop::More => return None,
            Stop::Here if s.starts_with(m.mark) => return Some((Lexeme::Mark, m.mark.len())),
            Stop::Here => match tag(s, m, 0, tags, true, end) {
                Found::Tag(l, n) => return Some((l, n)),
                _ => unreachable!("a tag was found here"),
            },
        }
    }
    Some((Lexeme::Text(s), s.len()))
}

enum Stop {
    Go,
    Here,
    More,
}

enum Found<'a> {
    Tag(Lexeme<'a>, usize),
    /// May be a tag once more text comes.
    More,
    No,
}

/// Whether a tag starts at byte `at` of `s` (with its `<` when `lt`).
fn tag<'a>(s: &'a str, m: &ToolMarkup, at: usize, tags: Tags, lt: bool, end: bool) -> Found<'a> {
    let mut i = at;
    if lt {
        debug_assert!(s[i..].starts_with('<'));
        i += 1;
    }
    let close = s[i..].starts_with('/');
    if close {
        i += 1;
    }
    let name_start = i;
    while let Some(c) = s[i..].chars().next() {
        if c.is_whitespace() || "<>/\"'=[]".contains(c) || i - name_start > MAX_NAME {
            break;
        }
        i += c.len_utf8();
    }
    let name = &s[name_start..i];
    let more = if end { Found::No } else { Found::More };
    // Which names may be tags here.
    let wanted = |n: &str| match (tags, lt) {
        (Tags::Any, true) => true,
        _ => n == m.invoke || n == m.block,
    };
    let could_be = |n: &str| match (tags, lt) {
        (Tags::Any, true) => true,
        _ => m.invoke.starts_with(n) || m.block.starts_with(n),
    };
    if i == s.len() {
        // The name may go on.
        return if name.len() <= MAX_NAME && could_be(name) { more } else { Found::No };
    }
    if name.is_empty() || name.len() > MAX_NAME || !wanted(name) {
        return Found::No;
    }
    let rest = &s[i..];
    if rest.starts_with('>') {
        let l = if close { Lexeme::Close(name) } else { Lexeme::Open { name, attrs: "" } };
        return Found::Tag(l, i + 1 - at);
    }
    // Attributes: only `<invoke name=...>`.
    if close || name != m.invoke || !rest.starts_with(char::is_whitespace) {
        return Found::No;
    }
    match rest.find(['>', '<']) {
        Some(j) if rest.as_bytes()[j] == b'>' && j <= MAX_ATTRS => {
            Found::Tag(Lexeme::Open { name, attrs: rest[..j].trim() }, i + j + 1 - at)
        }
        None if rest.len() <= MAX_ATTRS => more,
        _ => Found::No,
    }
}

/// The `name` attribute of `<invoke ...>`: `name="x"`, `name='x'` or `name=x`.
pub fn invoke_name(attrs: &str) -> Option<&str> {
    let v = attrs.strip_prefix("name")?.trim_start().strip_prefix('=')?.trim_start();
    for q in ['"', '\''] {
        if let Some(inner) = v.strip_prefix(q) {
            return inner.find(q).map(|j| &inner[..j]).filter(|n| !n.is_empty());
        }
    }
    let n = v.split_whitespace().next()?;
    (!n.is_empty()).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    static M: &ToolMarkup = &ToolMarkup { mark: "]<]minimax[>[", block: "tool_call", invoke: "invoke", item: "item" };

    fn all(s: &str, tags: Tags) -> Vec<Lexeme<'_>> {
        let mut out = Vec::new();
        let mut i = 0;
        while let Some((l, n)) = next(&s[i..], M, tags, matches!(out.last(), Some(Lexeme::Mark)), true) {
            out.push(l);
            i += n;
        }
        out
    }

    #[test]
    fn marks_tags_and_text_are_told_apart() {
        use Lexeme::*;
        let s = "a<b]<]minimax[>[<city>Paris]<]minimax[>[</city> x <y z";
        assert_eq!(
            all(s, Tags::Any),
            [Text("a<b"), Mark, Open { name: "city", attrs: "" }, Text("Paris"), Mark, Close("city"), Text(" x <y z")]
        );
        // Outside a call only the block's own tags count.
        assert_eq!(all("x <b>y</b> <tool_call>", Tags::Block), [Text("x <b>y</b> "), Open { name: "tool_call", attrs: "" }]);
        assert_eq!(all("<invoke name=\"f\">", Tags::Block), [Open { name: "invoke", attrs: "name=\"f\"" }]);
        // A mark, then an invoke without its `<`.
        assert_eq!(all("]<]minimax[>[invoke name=\"f\">", Tags::Block), [Mark, Open { name: "invoke", attrs: "name=\"f\"" }]);
        assert_eq!(all("]<]minimax[>[invoked", Tags::Block), [Mark, Text("invoked")]);
    }

    #[test]
    fn what_may_become_a_tag_waits_and_the_rest_goes_at_once() {
        assert_eq!(next("Par", M, Tags::Any, false, false), Some((Lexeme::Text("Par"), 3)));
        assert_eq!(next("Paris]<]mini", M, Tags::Any, false, false), Some((Lexeme::Text("Paris"), 5)));
        assert_eq!(next("]<]mini", M, Tags::Any, false, false), None);
        assert_eq!(next("</ci", M, Tags::Any, false, false), None);
        assert_eq!(next("a < b", M, Tags::Any, false, false), Some((Lexeme::Text("a < b"), 5)));
        assert_eq!(next("<tool_c", M, Tags::Block, false, false), None);
        assert_eq!(next("<tool_x", M, Tags::Block, false, false), Some((Lexeme::Text("<tool_x"), 7)));
        assert_eq!(next("<b", M, Tags::Block, false, false), Some((Lexeme::Text("<b"), 2)));
        assert_eq!(next("<invoke name=\"get_w", M, Tags::Block, false, false), None);
        assert_eq!(next("]<]mini", M, Tags::Any, false, true), Some((Lexeme::Text("]<]mini"), 7)));
    }

    #[test]
    fn invoke_names_are_read_quoted_or_not() {
        assert_eq!(invoke_name("name=\"get_weather\""), Some("get_weather"));
        assert_eq!(invoke_name("name='f'"), Some("f"));
        assert_eq!(invoke_name("name = f"), Some("f"));
        assert_eq!(invoke_name("name=\"\""), None);
        assert_eq!(invoke_name("id=\"f\""), None);
    }
}
