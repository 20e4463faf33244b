//! The check that docs/architecture.md's module map is the tree's: every
//! path the map names exists, every top-level module of `tracer/src` has a
//! row, and every file of the end-to-end tests is in their table. It runs
//! as a unit test of this crate, so `cargo xtask test` fails when the map
//! goes stale.

use std::path::{Path, PathBuf};

/// The folders a name in the map's second column may be relative to,
/// besides its own row's path.
const SOURCE_ROOTS: [&str; 6] = [
    "tracer/src",
    "tracer/offline/src",
    "tracer-ebpf/src",
    "tracer-common/src",
    "tests/e2e",
    "tests",
];

/// The names in backticks of `text` that look like a path: a Rust file
/// (`name.rs`) or a folder (`name/`).
fn path_names(text: &str) -> Vec<&str> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
                && (s.ends_with(".rs") || s.ends_with('/'))
                && !s.starts_with('/')
        })
        .collect()
}

/// Whether some file or folder below `dir` has a path ending in `name`.
fn found_below(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let path = e.path();
        let wanted = name.trim_end_matches('/');
        path.to_string_lossy().ends_with(&format!("/{wanted}"))
            || (path.is_dir() && found_below(&path, name))
    })
}

/// The rows of the markdown table that follows `heading`: the first cell
/// (without its backticks) and the second.
fn table_rows<'a>(doc: &'a str, heading: &str) -> Vec<(&'a str, &'a str)> {
    let after = doc.split_once(heading).map_or("", |(_, rest)| rest);
    after
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .filter_map(|l| {
            let mut cells = l.trim_matches('|').splitn(2, " | ");
            let first = cells.next()?.trim();
            // The path is the cell's first name in backticks.
            let first = first.split('`').nth(1).unwrap_or(first);
            Some((first, cells.next().unwrap_or("")))
        })
        .collect()
}

/// Everything the map says that the tree does not hold, one line each.
pub fn check(root: &Path) -> Vec<String> {
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap_or_default();
    let mut wrong = Vec::new();
    let layout = table_rows(&doc, "## Layout");
    if layout.is_empty() {
        wrong.push("docs/architecture.md has no Layout table".to_string());
    }
    for (path, what) in &layout {
        let row = root.join(path);
        if !row.exists() {
            wrong.push(format!("the map's row {path} does not exist"));
            continue;
        }
        let row_dir = if row.is_dir() {
            row.clone()
        } else {
            row.parent().map_or_else(PathBuf::new, Path::to_path_buf)
        };
        for name in path_names(what) {
            let found = row_dir.join(name).exists()
                || SOURCE_ROOTS
                    .iter()
                    .any(|r| root.join(r).join(name).exists())
                || found_below(&row_dir, name);
            if !found {
                wrong.push(format!("{name} (in the row of {path}) does not exist"));
            }
        }
    }
    // Every top-level module of the tracer has a row.
    let rows: Vec<&str> = layout.iter().map(|(p, _)| *p).collect();
    let src = root.join("tracer/src");
    for entry in std::fs::read_dir(&src).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let row = if entry.path().is_dir() {
            format!("tracer/src/{name}/")
        } else if name.ends_with(".rs") && name != "main.rs" {
            format!("tracer/src/{name}")
        } else {
            continue;
        };
        if !rows.contains(&row.as_str()) {
            wrong.push(format!("{row} has no row in the map"));
        }
    }
    // Every file of the end-to-end tests is in their table.
    let e2e = table_rows(&doc, "### End to end");
    let listed: Vec<&str> = e2e.iter().map(|(p, _)| *p).collect();
    for (file, _) in &e2e {
        if !root.join("tests/e2e").join(file).exists() {
            wrong.push(format!(
                "tests/e2e/{file} is in the table but does not exist"
            ));
        }
    }
    for entry in std::fs::read_dir(root.join("tests/e2e"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let shown = if entry.path().is_dir() {
            format!("{name}/")
        } else {
            name.clone()
        };
        let helper = ["main.rs", "support/", "support.rs"].contains(&shown.as_str());
        // A file's submodules are in a folder of its name (`agent.rs` and
        // `agent/`): either name lists both.
        let twin = match shown.strip_suffix('/') {
            Some(dir) => format!("{dir}.rs"),
            None => format!("{}/", shown.trim_end_matches(".rs")),
        };
        let is_listed = listed.contains(&shown.as_str()) || listed.contains(&twin.as_str());
        if (shown.ends_with(".rs") || shown.ends_with('/')) && !helper && !is_listed {
            wrong.push(format!("tests/e2e/{shown} is not in the table of tests"));
        }
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_module_map_is_the_tree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let wrong = check(&root);
        assert!(
            wrong.is_empty(),
            "docs/architecture.md is stale:\n{}",
            wrong.join("\n")
        );
    }

    #[test]
    fn a_missing_module_is_found() {
        let names = path_names("the rest (`gone.rs`, `there/`, `a b`, `x::y`)");
        assert_eq!(names, ["gone.rs", "there/"]);
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        assert!(!found_below(&root.join("tracer/src"), "gone_module_xyz.rs"));
        assert!(found_below(&root.join("tracer/src"), "pipeline.rs"));
    }
}
