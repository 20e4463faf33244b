//! The report's charts, drawn by plotters into SVG strings (its SVG
//! backend, no font files: plotters estimates text widths and the browser
//! draws the text).

use anyhow::Result;
use plotters::coord::ranged1d::SegmentedCoord;
use plotters::coord::types::RangedCoordu32;
use plotters::prelude::*;

use crate::render::text::short_count;

/// Width and height of every chart, in pixels.
const SIZE: (u32, u32) = (640, 280);
const LINE: RGBColor = RGBColor(0x1f, 0x6f, 0xb4);

/// An SVG of `size` on white, with a chart titled `title` (`x_labels`
/// pixels under it for the x axis) that `draw` builds and draws.
fn svg(
    size: (u32, u32),
    title: &str,
    x_labels: u32,
    draw: impl FnOnce(&mut ChartBuilder<'_, '_, SVGBackend<'_>>) -> Result<()>,
) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE)?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(x_labels)
            .y_label_area_size(80);
        draw(&mut builder)?;
        root.present()?;
    }
    Ok(svg)
}

/// The legend of `chart`'s series, at `position`.
fn legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

/// One line of a [`line`] chart: its name (in the legend when there are
/// several) and its points (seconds, value).
pub struct Series<'a> {
    pub name: &'a str,
    pub points: Vec<(f64, f64)>,
}

/// Colours of the lines, in order.
const LINES: [RGBColor; 2] = [LINE, RGBColor(0xd6, 0x27, 0x28)];

/// A line chart of `series` over time; `fmt` labels the y axis.
pub fn line(
    title: &str,
    y_desc: &str,
    series: &[Series<'_>],
    fmt: fn(f64) -> String,
) -> Result<String> {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let x_max = all().map(|p| p.0).fold(0.0, f64::max).max(1e-3);
    let y_max = all().map(|p| p.1).fold(0.0, f64::max).max(1.0) * 1.05;
    svg(SIZE, title, 40, |builder| {
        let mut chart = builder.build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_desc("seconds since tracing began")
            .y_desc(y_desc)
            .y_label_formatter(&|v| fmt(*v))
            .draw()?;
        for (s, color) in series.iter().zip(LINES.iter().cycle()) {
            // From the start of the trace: a step at the first point's
            // end would hide the first interval.
            let start = s.points.first().map(|p| (0.0, p.1));
            chart
                .draw_series(LineSeries::new(
                    start.into_iter().chain(s.points.iter().copied()),
                    color.stroke_width(2),
                ))?
                .label(s.name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        if series.len() > 1 {
            legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        }
        Ok(())
    })
}

/// Segments centred on 0, 1, ... n - 1 (plotters adds an empty one after
/// the last value; a range needs two values).
fn segments(n: u32) -> SegmentedCoord<RangedCoordu32> {
    (0..n.saturating_sub(1).max(1)).into_segmented()
}

/// A histogram: `bars` of (label, value) in order.
pub fn histogram(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    bars: &[(String, u64)],
) -> Result<String> {
    let n = bars.len() as u32;
    let y_max = bars.iter().map(|b| b.1).max().unwrap_or(0).max(1) as f64 * 1.05;
    svg(SIZE, title, 40, |builder| {
        let mut chart = builder.build_cartesian_2d(segments(n), 0f64..y_max)?;
        let label = |v: &SegmentValue<u32>| match v {
            SegmentValue::CenterOf(i) => {
                bars.get(*i as usize).map_or(String::new(), |b| b.0.clone())
            }
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(bars.len())
            .x_label_formatter(&label)
            .x_desc(x_desc)
            .y_desc(y_desc)
            .y_label_formatter(&|v| short_count(*v))
            .draw()?;
        chart.draw_series(
            Histogram::vertical(&chart)
                .style(LINE.filled())
                .margin(4)
                .data(bars.iter().enumerate().map(|(i, b)| (i as u32, b.1 as f64))),
        )?;
        Ok(())
    })
}

/// One stack's distribution in [`spread`]: its label and p50, p90, p99, max.
pub struct Spread {
    pub label: String,
    pub values: [u64; 4],
}

/// Per stack, p50, p90, p99 and max on a logarithmic axis, joined by a
/// line from p50 to max.
pub fn spread(
    title: &str,
    y_desc: &str,
    stacks: &[Spread],
    fmt: fn(f64) -> String,
) -> Result<String> {
    let n = stacks.len() as u32;
    let y_max = stacks.iter().map(|s| s.values[3]).max().unwrap_or(1).max(1) as f64 * 2.0;
    svg((SIZE.0, SIZE.1 + 40), title, 80, |builder| {
        let mut chart = builder.build_cartesian_2d(segments(n), (1f64..y_max).log_scale())?;
        let label = |v: &SegmentValue<u32>| match v {
            SegmentValue::CenterOf(i) => stacks
                .get(*i as usize)
                .map_or(String::new(), |s| s.label.clone()),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(stacks.len())
            .x_label_formatter(&label)
            .x_label_style(
                ("sans-serif", 11)
                    .into_font()
                    .transform(FontTransform::Rotate90),
            )
            .y_desc(y_desc)
            .y_label_formatter(&|v| fmt(*v))
            .draw()?;
        let at = |i: usize| SegmentValue::CenterOf(i as u32);
        let y = |v: u64| (v.max(1)) as f64;
        chart.draw_series(stacks.iter().enumerate().map(|(i, s)| {
            PathElement::new(
                vec![(at(i), y(s.values[0])), (at(i), y(s.values[3]))],
                BLACK.mix(0.4).stroke_width(2),
            )
        }))?;
        let marks: [(&str, RGBColor); 4] = [
            ("p50", RGBColor(0x1f, 0x6f, 0xb4)),
            ("p90", RGBColor(0x2c, 0xa0, 0x2c)),
            ("p99", RGBColor(0xff, 0x7f, 0x0e)),
            ("max", RGBColor(0xd6, 0x27, 0x28)),
        ];
        for (k, (name, color)) in marks.into_iter().enumerate() {
            chart
                .draw_series(
                    stacks
                        .iter()
                        .enumerate()
                        .map(move |(i, s)| Circle::new((at(i), y(s.values[k])), 4, color.filled())),
                )?
                .label(name)
                .legend(move |(x, y)| Circle::new((x + 8, y), 4, color.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    })
}
