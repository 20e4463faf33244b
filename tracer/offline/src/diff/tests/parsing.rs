//! The `--fail-if` condition language: the conditions it reads and the
//! error that names the bad part of one it does not.

use super::*;

#[test]
fn parses_conditions() {
    let c = cond("calls>+5%");
    assert_eq!(c.metric, Weight::Calls);
    assert!(!c.inclusive);
    assert_eq!(c.threshold, Threshold::Percent(Ratio { num: 5, den: 1 }));
    assert_eq!(c.to_string(), "calls>+5%");

    let c = cond("  bytes >= 1.5 MiB ");
    assert_eq!(c.text, "bytes >= 1.5 MiB");
    assert_eq!(c.metric, Weight::Bytes);
    assert!(c.inclusive);
    assert_eq!(
        c.threshold,
        Threshold::Amount(Ratio {
            num: 15 << 20,
            den: 10
        })
    );
    assert_eq!(
        cond("bytes>+2MB").threshold,
        Threshold::Amount(Ratio {
            num: 2_000_000,
            den: 1
        })
    );
    assert_eq!(
        cond("bytes>+512KiB").threshold,
        Threshold::Amount(Ratio {
            num: 512 << 10,
            den: 1
        })
    );
    assert_eq!(
        cond("bytes>3gb").threshold,
        Threshold::Amount(Ratio {
            num: 3_000_000_000,
            den: 1
        })
    );
    assert_eq!(
        cond("calls>+100").threshold,
        Threshold::Amount(Ratio { num: 100, den: 1 })
    );
    assert_eq!(
        cond("calls>5%"),
        Condition {
            text: "calls>5%".into(),
            ..cond("calls>+5%")
        }
    );
    assert_eq!(
        cond("CALLS>.5%").threshold,
        Threshold::Percent(Ratio { num: 5, den: 10 })
    );
    assert_eq!(
        cond("calls>007").threshold,
        Threshold::Amount(Ratio { num: 7, den: 1 })
    );
    assert_eq!(
        cond("calls>2.25%").threshold,
        Threshold::Percent(Ratio { num: 225, den: 100 })
    );
    assert_eq!(Ratio { num: 225, den: 100 }.as_f64(), 2.25);
}

#[test]
fn parse_errors_name_the_bad_part() {
    let err = |s: &str| parse_condition(s).unwrap_err();
    assert_eq!(
        err("calls>>5"),
        "bad --fail-if 'calls>>5': expected a number after '>'"
    );
    assert_eq!(
        err("calls>="),
        "bad --fail-if 'calls>=': expected a number after '>='"
    );
    assert_eq!(
        err("calls>%"),
        "bad --fail-if 'calls>%': expected a number after '>'"
    );
    assert_eq!(
        err(""),
        "bad --fail-if '': empty condition; expected for example 'calls>+5%' or 'bytes>+1MiB'"
    );
    assert_eq!(
        err("allocs>5%"),
        "bad --fail-if 'allocs>5%': unknown measure 'allocs': expected 'calls' or 'bytes'"
    );
    assert_eq!(
        err(">5%"),
        "bad --fail-if '>5%': expected 'calls' or 'bytes' at the start"
    );
    assert_eq!(
        err("calls"),
        "bad --fail-if 'calls': expected '>' or '>=' after 'calls'"
    );
    assert_eq!(
        err("calls<5%"),
        "bad --fail-if 'calls<5%': expected '>' or '>=' after 'calls', found '<' (only increases are gated)"
    );
    assert_eq!(
        err("calls=5"),
        "bad --fail-if 'calls=5': expected '>' or '>=' after 'calls', found '=' (only increases are gated)"
    );
    assert_eq!(
        err("calls 5"),
        "bad --fail-if 'calls 5': expected '>' or '>=' after 'calls', found '5' (only increases are gated)"
    );
    assert_eq!(
        err("calls>-5%"),
        "bad --fail-if 'calls>-5%': the threshold is an increase ('+5%' or '5%'), not '-5%'"
    );
    assert_eq!(
        err("calls>1.2.3"),
        "bad --fail-if 'calls>1.2.3': '1.2.3' is not a number"
    );
    assert_eq!(
        err("calls>5."),
        "bad --fail-if 'calls>5.': '5.' is not a number"
    );
    assert_eq!(
        err("calls>."),
        "bad --fail-if 'calls>.': '.' is not a number"
    );
    assert_eq!(
        err("calls>0.0000000001%"),
        "bad --fail-if 'calls>0.0000000001%': '0.0000000001' has too many decimals (at most 9)"
    );
    assert_eq!(
        err("calls>1000000000000000000"),
        "bad --fail-if 'calls>1000000000000000000': '1000000000000000000' is too large"
    );
    assert_eq!(
        err("bytes>5XB"),
        "bad --fail-if 'bytes>5XB': unknown unit 'XB' after '5': expected %, B, KiB, MiB, GiB, KB, MB or GB"
    );
    assert_eq!(
        err("bytes>5M"),
        "bad --fail-if 'bytes>5M': ambiguous unit 'M': write MiB (powers of 1024) or MB (powers of 1000)"
    );
    assert_eq!(
        err("calls>5MiB"),
        "bad --fail-if 'calls>5MiB': 'calls' takes a plain count or a percentage, not 'MiB'"
    );
    assert_eq!(
        err("calls>5%%"),
        "bad --fail-if 'calls>5%%': unexpected '%%' after '5': expected a plain count or a percentage"
    );
    assert_eq!(
        err("bytes>5% extra"),
        "bad --fail-if 'bytes>5% extra': unknown unit '% extra' after '5': expected %, B, KiB, MiB, GiB, KB, MB or GB"
    );
}
