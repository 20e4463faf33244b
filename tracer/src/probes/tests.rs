use super::{load::BPF_OBJECT, *};
use object::{Object, ObjectSymbol};
use tracer_common::Role;

/// The contract: every map and program name the tracer uses exists in
/// the BPF object it embeds.
#[test]
fn the_bpf_object_has_every_name_the_tracer_uses() {
    let file = object::File::parse(BPF_OBJECT).expect("the embedded BPF object parses");
    let symbols: Vec<String> = file
        .symbols()
        .filter_map(|s| s.name().ok().map(str::to_string))
        .collect();
    let has = |name: &str| symbols.iter().any(|s| s == name);
    let mut programs = vec![
        maps::FLOOR,
        maps::FLOOR_RET,
        maps::ALLOC_INLINE,
        maps::ALLOC_INLINE_RET,
        maps::RELEASE_INLINE,
    ];
    for role in Role::ALL {
        programs.push(role.program());
        programs.extend(role.return_program());
    }
    for name in programs {
        assert!(has(name), "program {name} missing from the BPF object");
    }
    for name in maps::ALL_MAPS
        .iter()
        .chain(&maps::EVENTS)
        .chain([&maps::CONFIG])
    {
        assert!(has(name), "map {name} missing from the BPF object");
    }
    assert!(file.section_by_name(".maps").is_some());
}
