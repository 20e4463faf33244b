//! Where the kernel keeps a thread's fs base (`task_struct.thread.fsbase`),
//! from the kernel's BTF: Python 3.10 and before name a thread state's
//! thread by `pthread_self()`, which is the fs base on x86_64.
//!
//! Hand-written: aya-obj parses BTF but keeps its type lookup private, and
//! only two struct members are wanted here. The format is the kernel's
//! (Documentation/bpf/btf.rst): a header, then the types, each a 12-byte
//! record and a tail whose size its kind sets, then the strings.

use std::sync::OnceLock;

/// `offsetof(struct task_struct, thread.fsbase)` on the running kernel.
pub fn task_fsbase_offset() -> Option<u32> {
    static OFFSET: OnceLock<Option<u32>> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let data = std::fs::read("/sys/kernel/btf/vmlinux").ok()?;
        let btf = Btf::parse(&data)?;
        let (thread, thread_type) = btf.member("task_struct", "thread")?;
        let name = btf.struct_name(thread_type)?;
        let (fsbase, _) = btf.member(name, "fsbase")?;
        Some(thread + fsbase)
    })
}

struct Btf<'a> {
    strings: &'a [u8],
    /// Every type: (name offset, kind, vlen, kind flag, its tail), by id - 1.
    types: Vec<Type<'a>>,
}

struct Type<'a> {
    name: u32,
    kind: u32,
    kind_flag: bool,
    tail: &'a [u8],
}

const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Option<Btf<'a>> {
        if data.get(0..2)? != [0x9f, 0xeb] {
            return None;
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let types_bytes = data.get(hdr_len + type_off..hdr_len + type_off + type_len)?;
        let strings = data.get(hdr_len + str_off..hdr_len + str_off + str_len)?;
        let mut types = Vec::new();
        let mut at = 0;
        while at + 12 <= types_bytes.len() {
            let name = u32_at(types_bytes, at)?;
            let info = u32_at(types_bytes, at + 4)?;
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let tail = match kind {
                1 | 14 | 17 => 4,             // int, var, decl tag
                3 => 12,                      // array
                4 | 5 | 15 | 19 => 12 * vlen, // struct, union, datasec, enum64
                6 | 13 => 8 * vlen,           // enum, func proto
                2 | 7..=12 | 16 | 18 => 0, // ptr, fwd, typedef, qualifiers, func, float, type tag
                _ => return None,
            };
            let start = at + 12;
            types.push(Type {
                name,
                kind,
                kind_flag: info >> 31 != 0,
                tail: types_bytes.get(start..start + tail)?,
            });
            at = start + tail;
        }
        Some(Btf { strings, types })
    }

    fn name(&self, off: u32) -> Option<&'a str> {
        let rest = self.strings.get(off as usize..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&rest[..end]).ok()
    }

    fn struct_name(&self, id: u32) -> Option<&'a str> {
        let t = self.types.get((id as usize).checked_sub(1)?)?;
        matches!(t.kind, KIND_STRUCT | KIND_UNION)
            .then(|| self.name(t.name))
            .flatten()
    }

    /// The byte offset and type id of member `member` of struct `name`.
    fn member(&self, name: &str, member: &str) -> Option<(u32, u32)> {
        let t = self
            .types
            .iter()
            .find(|t| t.kind == KIND_STRUCT && self.name(t.name) == Some(name))?;
        t.tail.chunks_exact(12).find_map(|m| {
            (self.name(u32_at(m, 0)?)? == member).then(|| {
                let bits = u32_at(m, 8)?;
                let bits = if t.kind_flag { bits & 0xff_ffff } else { bits };
                Some((bits / 8, u32_at(m, 4)?))
            })?
        })
    }
}

#[cfg(test)]
mod tests {
    /// The running kernel's BTF has the member (x86_64, Linux 6.x).
    #[test]
    fn finds_fsbase_in_task_struct() {
        let off = super::task_fsbase_offset().expect("kernel BTF with task_struct.thread.fsbase");
        assert!(off > 1000 && off.is_multiple_of(8), "{off}");
    }
}
