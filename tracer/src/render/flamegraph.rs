//! An SVG flame graph drawn by inferno from the folded format.

use anyhow::{bail, Context};
use inferno::flamegraph::color::{BasicPalette, Palette};
use inferno::flamegraph::{from_lines, Options};

use super::Weight;

/// Draws `folded` (the output of [`super::folded::render`]) as an SVG.
///
/// Input without any stack (empty, or only blank lines) is an error rather
/// than an SVG that only says "no valid input": the caller should tell the
/// user that nothing was traced instead of writing a useless file.
pub fn render(folded: &str, title: &str, weight: Weight) -> anyhow::Result<Vec<u8>> {
    if folded.lines().all(|line| line.trim().is_empty()) {
        bail!("no allocation stacks to draw");
    }
    // `Options` is non-exhaustive: start from the defaults.
    let mut options = Options::default();
    options.title = title.to_string();
    options.count_name = weight.unit().to_string();
    options.colors = Palette::Basic(BasicPalette::Mem);
    // Colors from a hash of the function name: the same input gives the same
    // picture.
    options.hash = true;
    let mut svg = Vec::new();
    from_lines(&mut options, folded.lines(), &mut svg)
        .context("inferno could not draw the flame graph")?;
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOLDED: &str = "main;make_node_[i];malloc 1000\nmain;grow;realloc 136\n";

    #[test]
    fn draws_an_svg() -> anyhow::Result<()> {
        let svg = String::from_utf8(render(FOLDED, "mtrace test", Weight::Calls)?)?;
        assert!(svg.contains("<svg"));
        assert!(svg.contains("make_node"));
        assert!(svg.contains("realloc"));
        assert!(svg.contains("mtrace test"));
        assert!(svg.contains("calls"));
        Ok(())
    }

    #[test]
    fn bytes_are_the_count_name() -> anyhow::Result<()> {
        let svg = String::from_utf8(render("main;malloc 4096\n", "t", Weight::Bytes)?)?;
        assert!(svg.contains("bytes"));
        Ok(())
    }

    #[test]
    fn same_input_same_svg() -> anyhow::Result<()> {
        assert_eq!(
            render(FOLDED, "t", Weight::Calls)?,
            render(FOLDED, "t", Weight::Calls)?
        );
        Ok(())
    }

    #[test]
    fn empty_input_is_an_error() {
        assert!(render("", "t", Weight::Calls).is_err());
        assert!(render("\n  \n", "t", Weight::Calls).is_err());
    }
}
