//! SVG flame graphs drawn by inferno from folded stacks: the plain one of
//! a profile, and the differential one of `mtrace diff` (inferno set up in
//! one place for both).

use anyhow::{bail, Context};
use inferno::flamegraph::color::{BasicPalette, Palette};
use inferno::flamegraph::{from_lines, Options};

use super::StackWeight;

/// Which flame graph [`render`] draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// From [`super::folded::render`]: `stack COUNT` lines.
    Plain,
    /// From [`super::folded::differential`]: `stack BASE NEW` lines. Frame
    /// widths are the NEW counts; each stack's allocator frame is red when
    /// it grew and blue when it shrank (inferno colours the last frame of
    /// each line by `NEW - BASE`, the frames below it stay near white).
    /// Stacks gone from NEW have no width, as in any differential flame
    /// graph: the table lists them.
    Differential,
}

/// Draws `folded` as an SVG.
///
/// Input without any stack (empty, or only blank lines) is an error rather
/// than an SVG that only says "no valid input": the caller should tell the
/// user that nothing was traced instead of writing a useless file.
pub fn render(
    folded: &str,
    title: &str,
    weight: impl Into<StackWeight>,
    kind: Kind,
) -> anyhow::Result<Vec<u8>> {
    let lines: Vec<&str> = folded.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        bail!("no allocation stacks to draw");
    }
    // `Options` is non-exhaustive: start from the defaults.
    let mut options = Options::default();
    options.title = title.to_string();
    options.count_name = weight.into().unit().to_string();
    // Colors from a hash of the function name: the same input gives the same
    // picture.
    options.hash = true;
    match kind {
        Kind::Plain => options.colors = Palette::Basic(BasicPalette::Mem),
        Kind::Differential => {
            let new_is_empty = lines.iter().all(|l| {
                l.split_whitespace()
                    .next_back()
                    .and_then(|n| n.parse::<u64>().ok())
                    == Some(0)
            });
            if new_is_empty {
                bail!("no allocations in the new profile: the differential flame graph is sized by it");
            }
            options.subtitle =
                Some("red: grew, blue: shrank (allocator frames); widths: new profile".into());
            // `NEW - BASE`: growth is red.
            options.negate_differentials = false;
        }
    }
    let mut svg = Vec::new();
    from_lines(&mut options, lines, &mut svg).context("inferno could not draw the flame graph")?;
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOLDED: &str = "main;make_node_[i];malloc 1000\nmain;grow;realloc 136\n";

    #[test]
    fn draws_an_svg() -> anyhow::Result<()> {
        let svg = String::from_utf8(render(
            FOLDED,
            "mtrace test",
            StackWeight::Calls,
            Kind::Plain,
        )?)?;
        assert!(svg.contains("<svg"));
        assert!(svg.contains("make_node"));
        assert!(svg.contains("realloc"));
        assert!(svg.contains("mtrace test"));
        assert!(svg.contains("calls"));
        Ok(())
    }

    #[test]
    fn bytes_are_the_count_name() -> anyhow::Result<()> {
        let svg = String::from_utf8(render(
            "main;malloc 4096\n",
            "t",
            StackWeight::Bytes,
            Kind::Plain,
        )?)?;
        assert!(svg.contains("bytes"));
        Ok(())
    }

    #[test]
    fn same_input_same_svg() -> anyhow::Result<()> {
        assert_eq!(
            render(FOLDED, "t", StackWeight::Calls, Kind::Plain)?,
            render(FOLDED, "t", StackWeight::Calls, Kind::Plain)?
        );
        Ok(())
    }

    #[test]
    fn empty_input_is_an_error() {
        assert!(render("", "t", StackWeight::Calls, Kind::Plain).is_err());
        assert!(render("\n  \n", "t", StackWeight::Calls, Kind::Plain).is_err());
    }
}
