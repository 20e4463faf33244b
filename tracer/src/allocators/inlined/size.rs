//! Where a copy's size is.

use super::{Kind, SizeAt, MAX_FIXED};
use crate::asm::{arg_code, flow::Value};

/// Where a copy's size is, from what the call through the pointer passes
/// (`None`: nowhere the probe can read it).
pub(super) fn size_of(args: [Value; 2], kind: Kind) -> Option<SizeAt> {
    let reg = |v: Value| match v {
        Value::Reg(r) => arg_code(r),
        _ => None,
    };
    if kind == Kind::Malloc {
        return match args[0] {
            Value::Const(n) => Some(SizeAt::Const(n)),
            v => reg(v).map(SizeAt::Reg),
        };
    }
    if kind == Kind::Free {
        return match args[0] {
            Value::Stack(d) if d < MAX_FIXED => Some(SizeAt::StackBlock(d)),
            v => reg(v).map(SizeAt::Block),
        };
    }
    if kind == Kind::Realloc {
        let ptr = reg(args[0]).unwrap_or(0);
        return match args[1] {
            // 0 is "no constant": a size of 0 read from a register.
            Value::Const(0) => None,
            Value::Const(fixed) => Some(SizeAt::Resize {
                ptr,
                size: 0,
                fixed,
            }),
            v => Some(SizeAt::Resize {
                ptr,
                size: reg(v)?,
                fixed: 0,
            }),
        };
    }
    match args {
        [Value::Const(n), Value::Const(m)] => Some(SizeAt::Const(n.saturating_mul(m))),
        [Value::Const(1), v] | [v, Value::Const(1)] => reg(v).map(SizeAt::Reg),
        [a, b] => Some(SizeAt::Product(reg(a)?, reg(b)?)),
    }
}
