# gdb, the oracle for stacks (gdb -batch -nx -x stacks.py --args PROG...):
# a breakpoint on every allocating function mtrace probes; at each hit,
# one line "STACK <function> <thread>:<rsp>:<return address> <frame>;..."
# from the innermost frame to the outermost, each frame "<R|I|T>|<object
# or empty for the executable>|<name>" (I: an inlined frame, T: a frame
# gdb infers for a tail call from the call-site information: neither is
# on the stack). The program runs on.
import os

import gdb

FUNCTIONS = [
    "malloc", "calloc", "realloc", "reallocarray", "posix_memalign",
    "aligned_alloc", "memalign", "valloc", "pvalloc",
    "_Znwm", "_Znam", "_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t",
]


class Hit(gdb.Breakpoint):
    def stop(self):
        frames = []
        f = gdb.newest_frame()
        rsp = int(f.read_register("rsp"))
        ret = int(gdb.selected_inferior().read_memory(rsp, 8).cast("Q")[0])
        where = "%d:%x:%x" % (gdb.selected_thread().ptid[1], rsp, ret)
        while f is not None:
            kind = {gdb.INLINE_FRAME: "I", gdb.TAILCALL_FRAME: "T"}.get(f.type(), "R")
            frames.append("%s|%s|%s" % (kind, gdb.solib_name(f.pc()) or "", f.name() or "??"))
            f = f.older()
        print("STACK %s %s %s" % (self.location, where, ";".join(frames)), flush=True)
        return False


for setting in ["pagination off", "confirm off", "breakpoint pending on",
                "backtrace past-main on", "backtrace past-entry on"]:
    gdb.execute("set " + setting)
# Rust's allocator shims, by their mangled names (the test finds them).
extra = os.environ.get("MTRACE_GDB_FUNCTIONS", "")
for name in FUNCTIONS + [n for n in extra.split(",") if n]:
    Hit(name)
gdb.execute("run")
