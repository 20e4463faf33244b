//! The pprof format (`profile.proto` of github.com/google/pprof), gzipped,
//! as read by `go tool pprof`, Pyroscope and Parca.
//!
//! Every allocation stack becomes one sample with two values,
//! `alloc_objects/count` (calls) and `alloc_space/bytes` (requested bytes).
//! Its locations are, leaf first: the allocator function itself, then one
//! location per machine address of the stack, innermost first. Frames that
//! share an address (inlined functions and the function they were inlined
//! into) become one location with several lines, the innermost inlined
//! function first and its caller last, as `profile.proto` specifies.
//!
//! Functions are shared by name and source file, locations by mapping,
//! address and lines, and there is one mapping per object file.

use std::io::Write as _;
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};
use flate2::{write::GzEncoder, Compression};
use prost::Message as _;

use crate::profile::Profile;

use super::{is_allocation, text};
use builder::{value, Builder};

mod builder;
pub mod proto;
#[cfg(test)]
mod tests;

/// Renders every allocation stack of `profile` as a gzipped pprof profile.
/// `free` entries are left out.
pub fn render(profile: &Profile) -> Result<Vec<u8>> {
    let message = build(profile)?;
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&message.encode_to_vec())?;
    Ok(gz.finish()?)
}

/// Renders `profile` as Go's heap profiles read (`/debug/pprof/allocs`
/// and `/debug/pprof/heap` of a Go program, which Parca and Grafana
/// Alloy scrape): the samples of [`render`], plus the period (`space`,
/// in bytes: 1 for an exact trace, the mean bytes between samples for a
/// sampled one), each sample's mean request size as its numeric `bytes`
/// label, its process as `pid` and `comm` labels, and `default_type`
/// (`alloc_space`, `inuse_space`) shown first.
pub fn render_go_heap(profile: &Profile, default_type: &str) -> Result<Vec<u8>> {
    let mut message = build(profile)?;
    let mut b = Builder::resume(std::mem::take(&mut message.string_table));
    message.period_type = Some(proto::ValueType {
        r#type: b.string("space"),
        unit: b.string("bytes"),
    });
    message.period = match &profile.meta.sampling {
        Some(s) if s.kind == "bytes" => value(s.rate),
        _ => 1,
    };
    message.default_sample_type = b.string(default_type);
    if let Some(w) = &profile.meta.windows {
        let line = text::windows_line(w, profile.meta.duration_secs);
        message.comment.push(b.string(&line));
    }
    let entries = profile.stacks.iter().filter(|e| is_allocation(e));
    for (sample, entry) in message.sample.iter_mut().zip(entries) {
        // A Go heap row has its objects' size labelled already, exactly.
        let mean = match entry.object_size {
            Some(_) => None,
            None => entry.counts.bytes.checked_div(entry.counts.calls),
        };
        if let Some(mean) = mean {
            sample.label.push(proto::Label {
                key: b.string("bytes"),
                num: value(mean),
                num_unit: b.string("bytes"),
                ..Default::default()
            });
        }
        if let Some(p) = &entry.process {
            sample.label.push(proto::Label {
                key: b.string("pid"),
                num: i64::from(p.pid),
                ..Default::default()
            });
            sample.label.push(proto::Label {
                key: b.string("comm"),
                str: b.string(&p.name),
                ..Default::default()
            });
        }
    }
    message.string_table = b.strings;
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&message.encode_to_vec())?;
    Ok(gz.finish()?)
}

/// The (uncompressed) profile message.
fn build(profile: &Profile) -> Result<proto::Profile> {
    let meta = &profile.meta;
    let mut b = Builder::new();
    b.add_mappings(profile);

    let mut sample_type = vec![
        proto::ValueType {
            r#type: b.string("alloc_objects"),
            unit: b.string("count"),
        },
        proto::ValueType {
            r#type: b.string("alloc_space"),
            unit: b.string("bytes"),
        },
    ];
    // Live mode: what was still allocated when tracing ended, as
    // go tool pprof's heap profiles name it; a Go program's own heap has
    // it too (malloc's rows hold 0 there outside live mode).
    let with_inuse = profile.live.is_some() || profile.stacks.iter().any(|e| e.in_use.is_some());
    if with_inuse {
        sample_type.push(proto::ValueType {
            r#type: b.string("inuse_objects"),
            unit: b.string("count"),
        });
        sample_type.push(proto::ValueType {
            r#type: b.string("inuse_space"),
            unit: b.string("bytes"),
        });
    }
    let default_sample_type = b.string(if profile.live.is_some() {
        "inuse_space"
    } else {
        "alloc_space"
    });

    let samples: Vec<proto::Sample> = profile
        .stacks
        .iter()
        .filter(|e| is_allocation(e))
        .map(|e| b.sample(e, &meta.allocator_object, with_inuse))
        .collect();

    let version = if meta.mtrace_version.is_empty() {
        env!("CARGO_PKG_VERSION")
    } else {
        &meta.mtrace_version
    };
    let mut comment = vec![b.string(&format!(
        "mtrace {version}, pid {}: {}",
        meta.pid, meta.command
    ))];
    if let Some(q) = &profile.stack_quality {
        comment.push(b.string(&text::quality_line(q)));
    }
    for g in &profile.go_heaps {
        comment.push(b.string(&format!(
            "go heap: pid {} ({}), {}: its runtime's sampled profile, one sample per {} bytes, scaled as Go scales it",
            g.pid, g.name, g.version, g.rate
        )));
    }

    Ok(proto::Profile {
        sample_type,
        sample: samples,
        mapping: b.mappings,
        location: b.locations,
        function: b.functions,
        string_table: b.strings,
        time_nanos: time_nanos(&meta.start_time)?,
        duration_nanos: duration_nanos(meta.duration_secs),
        comment,
        default_sample_type,
        ..Default::default()
    })
}

/// Nanoseconds since the epoch of an RFC 3339 time; 0 when there is none.
fn time_nanos(start_time: &str) -> Result<i64> {
    if start_time.is_empty() {
        return Ok(0);
    }
    let time = humantime::parse_rfc3339(start_time)
        .with_context(|| format!("bad start time {start_time:?} in the profile"))?;
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    Ok(i64::try_from(since_epoch.as_nanos()).unwrap_or(i64::MAX))
}

fn duration_nanos(secs: f64) -> i64 {
    if secs.is_finite() && secs > 0.0 {
        // `as` saturates.
        (secs * 1e9).round() as i64
    } else {
        0
    }
}
