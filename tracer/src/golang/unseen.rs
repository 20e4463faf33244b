//! Heaps that are neither malloc nor readable: a JVM's Java heap and V8's
//! JavaScript heap are their runtimes' own, allocated by bumping a pointer
//! in memory they took once, with no call to probe and no profile to
//! read. A process that runs one is said in one line, so that what its
//! report lacks is not taken for what it does not do; its malloc calls
//! are counted all the same. A JVM whose compiled code keeps no frame
//! pointer (HotSpot's default) is said too: its stacks end at the first
//! compiled Java frame, and the line names the option that makes them
//! whole.

use crate::{profile::Unseen, tracee::Mapping};

/// What `maps` say the process keeps unseen: the heap it runs beside
/// malloc's, and a JVM's stacks past its first Java frame where its
/// compiled code keeps no frame pointer.
pub fn detect(pid: u32, name: &str, exe: &str, maps: &[Mapping]) -> Vec<Unseen> {
    let mut out: Vec<Unseen> = heap(pid, name, exe, maps).into_iter().collect();
    if crate::unwind::jit::hotspot_frame_pointers(pid, maps) == Some(false) {
        out.push(Unseen {
            pid,
            name: name.to_string(),
            heap: "java stacks".into(),
            why: format!(
                "a JVM without {0}: its compiled Java code keeps no frame pointer, so stacks end at the first Java frame; run it with {0} (and `jcmd PID Compiler.perfmap` for the Java methods' names) for whole stacks",
                crate::unwind::jit::PRESERVE_FRAME_POINTER
            ),
        });
    }
    out
}

/// The heap `maps` say the process runs beside malloc's, unseen.
fn heap(pid: u32, name: &str, exe: &str, maps: &[Mapping]) -> Option<Unseen> {
    let file = |m: &Mapping| crate::profile::short_path(&m.path).to_string();
    let maps_lib = |prefix: &str| maps.iter().any(|m| file(m).starts_with(prefix));
    let exe_name = crate::profile::short_path(exe);
    let (heap, why) = if maps_lib("libjvm.so") {
        (
            "java heap",
            "a JVM: Java objects live in its own heap, not malloc's, and are not counted (its malloc calls are)",
        )
    } else if maps_lib("libnode.so") || exe_name == "node" || exe_name == "nodejs" {
        (
            "v8 heap",
            "node: JavaScript objects live in V8's own heap, not malloc's, and are not counted (its malloc calls are)",
        )
    } else {
        return None;
    };
    Some(Unseen {
        pid,
        name: name.to_string(),
        heap: heap.into(),
        why: why.into(),
    })
}
