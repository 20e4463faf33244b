//! The tree bench's `make -j2` row: a generated C project of
//! [`UNITS`] files built from clean, untraced, under `mtrace --` and under
//! `mtrace --file-wide`.

use std::{path::Path, process::Command};

use anyhow::Result;

use super::tree::{best, timed};

/// `make -j2` of a generated C project: every file compiled, linked, run.
pub struct MakeRow {
    pub(super) units: usize,
    pub(super) untraced_s: f64,
    pub(super) mtrace_s: f64,
    /// Under `mtrace --file-wide`.
    pub(super) file_wide_s: f64,
    /// Processes the trace saw, and how many it traced.
    pub(super) processes: u64,
    pub(super) traced: u64,
}

/// Translation units of the generated project.
pub(super) const UNITS: usize = 50;

/// A C project of [`UNITS`] files, each a function that allocates, and a
/// main that calls them all; its Makefile builds and runs it.
pub(super) fn make_project(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut main = String::from("#include <stdlib.h>\n");
    let mut objs = Vec::new();
    for i in 0..UNITS {
        std::fs::write(
            dir.join(format!("unit{i}.c")),
            format!(
                "#include <stdlib.h>\n#include <string.h>\nvoid *volatile sink{i};\nvoid unit{i}(void) {{\n    for (int j = 0; j < {n}; j++) {{\n        char *p = malloc({size});\n        memset(p, j, {size});\n        sink{i} = p;\n        free(p);\n    }}\n}}\n",
                n = 10 + i,
                size = 16 + 8 * i
            ),
        )?;
        main.push_str(&format!("void unit{i}(void);\n"));
        objs.push(format!("unit{i}.o"));
    }
    main.push_str("int main(void) {\n");
    for i in 0..UNITS {
        main.push_str(&format!("    unit{i}();\n"));
    }
    main.push_str("    return 0;\n}\n");
    std::fs::write(dir.join("main.c"), main)?;
    std::fs::write(
        dir.join("Makefile"),
        format!(
            "OBJS = main.o {}\nall: prog\n\t./prog\nprog: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n%.o: %.c\n\t$(CC) -O2 -c -o $@ $<\nclean:\n\trm -f prog *.o\n",
            objs.join(" ")
        ),
    )?;
    Ok(())
}

/// `make -j2` from clean, untraced and under mtrace, best of `runs`.
pub(super) fn make_row(root: &Path, out_dir: &Path, runs: usize) -> Result<MakeRow> {
    let dir = out_dir.join("make-project");
    make_project(&dir)?;
    let make = |mtrace: Option<(&Path, &[&str], &str)>| -> Result<f64> {
        timed(Command::new("make").arg("-C").arg(&dir).arg("clean"))?;
        match mtrace {
            None => timed(Command::new("make").arg("-C").arg(&dir).arg("-j2")),
            Some((m, extra, json)) => timed(
                Command::new(m)
                    .args(extra)
                    .args(["--top", "0", "-o"])
                    .arg(out_dir.join(json))
                    .args(["--", "make", "-C"])
                    .arg(&dir)
                    .arg("-j2"),
            ),
        }
    };
    let untraced_s = best(runs, || make(None))?;
    let mtrace = root.join("target/release/mtrace");
    let mtrace_s = best(runs, || make(Some((&mtrace, &[], "make.json"))))?;
    let file_wide_s = best(runs, || {
        make(Some((&mtrace, &["--file-wide"], "make-file-wide.json")))
    })?;
    let json = std::fs::read_to_string(out_dir.join("make.json"))?;
    let processes = json.matches("\"traced\": ").count() as u64;
    let traced = json.matches("\"traced\": true").count() as u64;
    Ok(MakeRow {
        units: UNITS,
        untraced_s,
        mtrace_s,
        file_wide_s,
        processes,
        traced,
    })
}
