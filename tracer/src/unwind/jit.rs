//! JIT runtimes whose code keeps frame pointers: HotSpot run with
//! `-XX:+PreserveFramePointer` sets up rbp in every compiled method as C
//! code built with frame pointers does, and its interpreter, its native
//! method wrappers and the stub that enters Java from the VM always do.
//! Its interpreter returns to entry points that follow no call
//! instruction (it pushes the return address and jumps), so the check the
//! walk makes of an unknown frame pointer (the address it leads to must
//! follow a call) would stop it at the first interpreted frame: in such a
//! JVM a frame pointer that leads into its code heap is followed too.

use crate::tracee::Mapping;

/// The JVM option that makes compiled Java methods keep frame pointers.
pub const PRESERVE_FRAME_POINTER: &str = "-XX:+PreserveFramePointer";

/// What `pid` is, as far as the walk through its JIT code goes: `None`
/// when it is not a JVM (no libjvm.so in `maps`), else whether its
/// compiled code keeps frame pointers.
pub fn hotspot_frame_pointers(pid: u32, maps: &[Mapping]) -> Option<bool> {
    let jvm = maps
        .iter()
        .any(|m| crate::profile::short_path(&m.path) == "libjvm.so");
    if !jvm {
        return None;
    }
    let args = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    Some(keeps_frame_pointers(&args, &env))
}

/// Whether the JVM options in a command line and an environment (each
/// NUL-separated, as /proc gives them) turn `PreserveFramePointer` on.
/// HotSpot reads `JAVA_TOOL_OPTIONS` first, then the launcher's
/// `JDK_JAVA_OPTIONS` and the command line, then `_JAVA_OPTIONS`; the last
/// setting wins. Its default is off. (An argument of the application's
/// own spelled as the option is taken for it: the launcher's grammar is
/// not parsed.)
fn keeps_frame_pointers(cmdline: &[u8], environ: &[u8]) -> bool {
    let var = |name: &str| -> Vec<&[u8]> {
        environ
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(name.as_bytes())?.strip_prefix(b"="))
            .map(|v| v.split(u8::is_ascii_whitespace).collect())
            .unwrap_or_default()
    };
    let options = var("JAVA_TOOL_OPTIONS")
        .into_iter()
        .chain(var("JDK_JAVA_OPTIONS"))
        .chain(cmdline.split(|&b| b == 0))
        .chain(var("_JAVA_OPTIONS"));
    let mut on = false;
    for option in options {
        if option == PRESERVE_FRAME_POINTER.as_bytes() {
            on = true;
        } else if option == b"-XX:-PreserveFramePointer" {
            on = false;
        }
    }
    on
}

/// Code a JIT wrote: executable memory no file backs, the vDSO aside (it
/// has call-frame information of its own and keeps no frame pointers).
pub fn is_jit_code(m: &Mapping) -> bool {
    m.is_anonymous_code() && (m.path.is_empty() || m.path.starts_with("[anon"))
}

#[cfg(test)]
mod tests {
    use super::keeps_frame_pointers;

    #[test]
    fn the_last_setting_wins() {
        let on = b"java\0-XX:+PreserveFramePointer\0-cp\0.\0Z\0";
        assert!(keeps_frame_pointers(on, b""));
        assert!(!keeps_frame_pointers(b"java\0Z\0", b""));
        assert!(keeps_frame_pointers(
            b"java\0Z\0",
            b"A=1\0JAVA_TOOL_OPTIONS=-Xmx1g -XX:+PreserveFramePointer\0"
        ));
        assert!(!keeps_frame_pointers(
            on,
            b"_JAVA_OPTIONS=-XX:-PreserveFramePointer\0"
        ));
        assert!(keeps_frame_pointers(
            on,
            b"JAVA_TOOL_OPTIONS=-XX:-PreserveFramePointer\0"
        ));
        assert!(!keeps_frame_pointers(
            b"java\0-XX:+PreserveFramePointers\0",
            b""
        ));
    }
}
