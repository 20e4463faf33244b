//! SVG flame graphs drawn by inferno from folded stacks: the plain one of
//! a profile, and the differential one of `mtrace diff` (inferno set up in
//! one place for both).

use std::collections::{BTreeSet, HashMap};

use anyhow::{bail, Context};
use inferno::flamegraph::color::{BasicPalette, Palette};
use inferno::flamegraph::{from_lines, Options};
use quick_xml::events::{attributes::Attribute, BytesText, Event};

use super::text::thousands;
use super::StackWeight;

/// Which flame graph [`render`] draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// From [`super::folded::render`]: `stack COUNT` lines.
    Plain,
    /// From [`super::folded::differential`]: `stack BASE NEW` lines. Frame
    /// widths are the NEW counts. Every frame is red when what it calls
    /// grew and blue when it shrank, and its title gives that change:
    /// `NEW - BASE` summed over every line through the frame (inferno alone
    /// gives a change only to the last frame of each line). Stacks gone
    /// from NEW have no width, as in any differential flame graph, but
    /// their change counts in the frames below them; the table lists them.
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
    let mut lines: Vec<&str> = folded.lines().filter(|l| !l.trim().is_empty()).collect();
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
            options.subtitle = Some(
                "red: grew, blue: shrank (each frame by all it calls); widths: new profile".into(),
            );
            // `NEW - BASE`: growth is red.
            options.negate_differentials = false;
            // Sorted here, in inferno's order, so that [`subtree_changes`]
            // lays the frames out as inferno does.
            lines.sort_unstable();
            options.no_sort = true;
        }
    }
    let mut svg = Vec::new();
    from_lines(&mut options, lines.iter().copied(), &mut svg)
        .context("inferno could not draw the flame graph")?;
    if kind == Kind::Differential {
        svg = with_subtree_changes(&svg, &subtree_changes(&lines)?, &options.count_name)?;
    }
    Ok(svg)
}

/// Where inferno draws a frame: its depth (0: the `all` frame), its first
/// sample and its width in samples (never 0: inferno draws no frame
/// without width).
type Place = (usize, u64, u64);

/// The frames of a differential flame graph as inferno lays them out from
/// `lines` (`stack BASE NEW`, sorted), with the change `NEW - BASE` of
/// every line through each, and the new profile's total.
///
/// Inferno merges a line's frames with the previous line's as far as
/// they match and starts the rest at the samples drawn so far; a line
/// adds its NEW count to them. The same walk here gives each frame's
/// place and sums the lines through it.
struct Layout {
    change: HashMap<Place, i128>,
    total: u64,
}

fn subtree_changes(lines: &[&str]) -> anyhow::Result<Layout> {
    struct Open<'a> {
        name: &'a str,
        start: u64,
        change: i128,
    }
    let mut layout = Layout {
        change: HashMap::new(),
        total: 0,
    };
    let close = |layout: &mut Layout, depth: usize, frame: Open| {
        let time = layout.total;
        if time > frame.start {
            layout
                .change
                .insert((depth, frame.start, time - frame.start), frame.change);
        }
    };
    // The `all` frame first, then the current line's frames.
    let mut open = vec![Open {
        name: "",
        start: 0,
        change: 0,
    }];
    for line in lines {
        let mut fields = line.trim().rsplitn(3, char::is_whitespace);
        let (Some(new), Some(base), Some(stack)) = (fields.next(), fields.next(), fields.next())
        else {
            bail!("not a differential folded line: {line:?}");
        };
        let (Ok(new), Ok(base)) = (new.parse::<u64>(), base.parse::<u64>()) else {
            bail!("not a differential folded line: {line:?}");
        };
        let names: Vec<&str> = stack.trim_end().split(';').collect();
        let same = names
            .iter()
            .zip(&open[1..])
            .take_while(|(n, o)| **n == o.name)
            .count();
        while open.len() > same + 1 {
            let frame = open.pop().expect("more than the all frame is open");
            close(&mut layout, open.len(), frame);
        }
        open.extend(names[same..].iter().map(|name| Open {
            name,
            start: layout.total,
            change: 0,
        }));
        for frame in &mut open {
            frame.change += i128::from(new) - i128::from(base);
        }
        layout.total += new;
    }
    while let Some(frame) = open.pop() {
        close(&mut layout, open.len(), frame);
    }
    Ok(layout)
}

/// Inferno's differential `svg` with each frame's title and colour given
/// by the change of all it calls (`layout`), in `unit`s: `parse_record
/// (1,200 calls, 81.03%; +200 calls, +13.50%)`, the percentage of the new
/// profile's total as inferno gives it, and the colour on inferno's scale,
/// full at the largest change of any frame.
fn with_subtree_changes(svg: &[u8], layout: &Layout, unit: &str) -> anyhow::Result<Vec<u8>> {
    use quick_xml::{Reader, Writer};
    // A frame is a rect with an `fg:x` attribute; its depth is the rank of
    // its `y` from the bottom (inferno draws no frame whose parent it does
    // not draw, so every depth up to the deepest has frames).
    let rect_place =
        |e: &quick_xml::events::BytesStart| -> anyhow::Result<Option<(u64, u64, u64)>> {
            let attr = |name: &str| -> anyhow::Result<Option<u64>> {
                match e.try_get_attribute(name)? {
                    Some(a) => Ok(Some(std::str::from_utf8(&a.value)?.parse()?)),
                    None => Ok(None),
                }
            };
            Ok(match (attr("y")?, attr("fg:x")?, attr("fg:w")?) {
                (Some(y), Some(x), Some(w)) => Some((y, x, w)),
                _ => None,
            })
        };
    let mut ys = BTreeSet::new();
    let mut reader = Reader::from_reader(svg);
    loop {
        match reader.read_event()? {
            Event::Empty(e) if e.name().as_ref() == b"rect" => {
                if let Some((y, _, _)) = rect_place(&e)? {
                    ys.insert(y);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    let depth_of: HashMap<u64, usize> = ys.iter().rev().enumerate().map(|(d, &y)| (y, d)).collect();
    let biggest = layout
        .change
        .values()
        .map(|c| c.unsigned_abs())
        .max()
        .unwrap_or(0)
        .max(1);

    let mut out = Writer::new(Vec::with_capacity(svg.len() + svg.len() / 8));
    let mut reader = Reader::from_reader(svg);
    // A title's events, held from its start until the element after its
    // end says whether it is a frame's; whether its end was read.
    let mut title: Option<Vec<Event>> = None;
    let mut title_closed = false;
    loop {
        let event = reader.read_event()?;
        if let Some(held) = title.as_mut() {
            if !title_closed {
                title_closed = matches!(&event, Event::End(e) if e.name().as_ref() == b"title");
                held.push(event);
                continue;
            }
            let held = title.take().expect("a title is held");
            let frame = match &event {
                Event::Empty(e) if e.name().as_ref() == b"rect" => rect_place(e)?,
                _ => None,
            };
            let Some((y, x, w)) = frame else {
                for e in held {
                    out.write_event(e)?;
                }
                out.write_event(event)?;
                continue;
            };
            let depth = depth_of[&y];
            let Some(&change) = layout.change.get(&(depth, x, w)) else {
                bail!("the differential flame graph has a frame (depth {depth}, samples {x}+{w}) its layout lacks");
            };
            let text = title_text(&held)?;
            let Event::Empty(rect) = event else {
                unreachable!("a frame is a rect")
            };
            let mut recoloured = rect.to_owned();
            recoloured.clear_attributes();
            for a in rect.attributes() {
                let a = a?;
                if a.key.as_ref() == b"fill" {
                    let (r, g, b) = change_colour(change, biggest);
                    recoloured.push_attribute(("fill", format!("rgb({r},{g},{b})").as_str()));
                } else {
                    recoloured.push_attribute(Attribute {
                        key: a.key,
                        value: a.value,
                    });
                }
            }
            out.write_event(held[0].borrow())?;
            out.write_event(Event::Text(BytesText::new(&retitled(
                &text,
                change,
                layout.total,
                unit,
            ))))?;
            out.write_event(held[held.len() - 1].borrow())?;
            out.write_event(Event::Empty(recoloured))?;
            continue;
        }
        match event {
            Event::Start(e) if e.name().as_ref() == b"title" => {
                title = Some(vec![Event::Start(e)]);
                title_closed = false;
            }
            Event::Eof => break,
            e => out.write_event(e)?,
        }
    }
    Ok(out.into_inner())
}

/// The text of a title's events (its start, its text and references, its
/// end), unescaped.
fn title_text(events: &[Event]) -> anyhow::Result<String> {
    let mut raw = String::new();
    for e in events {
        match e {
            Event::Text(t) => raw.push_str(&t.decode()?),
            Event::GeneralRef(r) => {
                raw.push('&');
                raw.push_str(&r.decode()?);
                raw.push(';');
            }
            _ => {}
        }
    }
    Ok(quick_xml::escape::unescape(&raw)?.into_owned())
}

/// Inferno's frame title (`f (1,200 calls, 81.03%; +1.20%)`, or `all
/// (1,481 calls, 100%)`) with the change it gives (the frame's own line's,
/// if any) replaced by `change`: `f (1,200 calls, 81.03%; +200 calls,
/// +13.50%)`, or `...; unchanged)`. Frame names hold no `;` (the folded
/// format's separator).
fn retitled(title: &str, change: i128, total: u64, unit: &str) -> String {
    let head = match title.rfind("; ") {
        Some(at) => &title[..at],
        None => title.strip_suffix(')').unwrap_or(title),
    };
    if change == 0 {
        return format!("{head}; unchanged)");
    }
    let sign = if change > 0 { '+' } else { '-' };
    let magnitude = u64::try_from(change.unsigned_abs()).unwrap_or(u64::MAX);
    format!(
        "{head}; {sign}{} {unit}, {sign}{:.2}%)",
        thousands(magnitude),
        100.0 * magnitude as f64 / total.max(1) as f64
    )
}

/// Inferno's differential colour (`color_scale`, not public): near white
/// for no change, red for growth and blue for a fall, deepest at
/// `biggest`.
fn change_colour(change: i128, biggest: u128) -> (u8, u8, u8) {
    let pale = |c: u128| (100 + 150 * (biggest - c.min(biggest)) / biggest) as u8;
    match change.cmp(&0) {
        std::cmp::Ordering::Equal => (250, 250, 250),
        std::cmp::Ordering::Greater => {
            let c = pale(change.unsigned_abs());
            (255, c, c)
        }
        std::cmp::Ordering::Less => {
            let c = pale(change.unsigned_abs());
            (c, c, 255)
        }
    }
}

/// Each frame of an SVG drawn here, in the order drawn: its title
/// (unescaped) and its fill. Read back by an XML parser, for tests and
/// tools that check a flame graph.
pub fn drawn_frames(svg: &[u8]) -> anyhow::Result<Vec<(String, String)>> {
    let mut reader = quick_xml::Reader::from_reader(svg);
    reader.config_mut().check_end_names = true;
    let (mut frames, mut title, mut in_title) = (Vec::new(), String::new(), false);
    loop {
        match reader.read_event()? {
            Event::Start(e) if e.name().as_ref() == b"title" => {
                in_title = true;
                title.clear();
            }
            Event::End(e) if e.name().as_ref() == b"title" => in_title = false,
            Event::Text(t) if in_title => title.push_str(&t.xml10_content()?),
            Event::GeneralRef(r) if in_title => {
                title.push_str(&quick_xml::escape::unescape(&format!("&{};", r.decode()?))?)
            }
            Event::Empty(e) if e.name().as_ref() == b"rect" => {
                if let (Some(fill), Some(_)) =
                    (e.try_get_attribute("fill")?, e.try_get_attribute("fg:x")?)
                {
                    frames.push((title.clone(), String::from_utf8(fill.value.into_owned())?));
                }
            }
            Event::Eof => return Ok(frames),
            _ => {}
        }
    }
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

    /// A frame's change is that of all it calls: `parse_record` gains 200
    /// calls through `malloc` and loses 10 through `helper`, which are gone
    /// (drawn without width, yet counted below); `main` the same, `other`
    /// nothing. Inferno alone gives `parse_record` and `main` no change.
    #[test]
    fn every_frame_changes_by_all_it_calls() -> anyhow::Result<()> {
        let folded = "main;other;malloc 300 300\n\
                      main;parse_record;helper;calloc 10 0\n\
                      main;parse_record;malloc 1000 1200\n\
                      main;parse<&>;malloc 5 5\n";
        let svg = render(folded, "t", StackWeight::Calls, Kind::Differential)?;
        let frames = drawn_frames(&svg)?;
        let title = |name: &str| -> (String, String) {
            frames
                .iter()
                .find(|(t, _)| t.starts_with(&format!("{name} (")))
                .unwrap_or_else(|| panic!("no frame {name} in {frames:?}"))
                .clone()
        };
        assert_eq!(
            title("all"),
            (
                "all (1,505 calls, 100%; +190 calls, +12.62%)".into(),
                "rgb(255,107,107)".into()
            )
        );
        assert_eq!(
            title("main"),
            (
                "main (1,505 calls, 100.00%; +190 calls, +12.62%)".into(),
                "rgb(255,107,107)".into()
            )
        );
        // +190 against the largest change, malloc's +200 below it.
        assert_eq!(
            title("parse_record"),
            (
                "parse_record (1,200 calls, 79.73%; +190 calls, +12.62%)".into(),
                "rgb(255,107,107)".into()
            )
        );
        assert_eq!(
            title("other"),
            (
                "other (300 calls, 19.93%; unchanged)".into(),
                "rgb(250,250,250)".into()
            )
        );
        assert_eq!(title("parse<&>").0, "parse<&> (5 calls, 0.33%; unchanged)");
        assert!(
            frames.contains(&(
                "malloc (1,200 calls, 79.73%; +200 calls, +13.29%)".into(),
                "rgb(255,100,100)".into()
            )),
            "{frames:?}"
        );
        assert!(
            frames.iter().all(|(t, _)| !t.starts_with("helper")),
            "{frames:?}"
        );
        Ok(())
    }

    #[test]
    fn empty_input_is_an_error() {
        assert!(render("", "t", StackWeight::Calls, Kind::Plain).is_err());
        assert!(render("\n  \n", "t", StackWeight::Calls, Kind::Plain).is_err());
    }
}
