//! `mtrace ls`: a word where a subcommand or an option was expected, most
//! likely a command meant to be traced without the `--` before it.

use clap::{error::ContextKind, error::ContextValue, CommandFactory};

use super::Cli;

/// For clap's "unexpected argument WORD" at the top level, with WORD not
/// an option: `unknown command 'WORD'; to trace it: mtrace ... -- WORD ...`
/// (the arguments before it kept, the ones after it following it).
/// `args` are mtrace's arguments without the program name.
pub fn hint(e: &clap::Error, args: &[String]) -> Option<String> {
    if e.kind() != clap::error::ErrorKind::UnknownArgument {
        return None;
    }
    let Some(ContextValue::String(word)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    if word.starts_with('-') {
        return None;
    }
    let cmd = Cli::command();
    let subcommands: Vec<&str> = cmd.get_subcommands().map(|s| s.get_name()).collect();
    // Where clap met it: the first WORD that is not an option's value.
    let mut at = None;
    let mut value_next = false;
    for (i, arg) in args.iter().enumerate() {
        if arg == "--" || subcommands.contains(&arg.as_str()) {
            break;
        }
        if !value_next && arg == word {
            at = Some(i);
            break;
        }
        value_next = !arg.contains('=') && takes_value(&cmd, arg);
    }
    let at = at?;
    let mut suggestion = vec!["mtrace".to_string()];
    suggestion.extend(args[..at].iter().map(|a| quote(a)));
    suggestion.push("--".into());
    suggestion.extend(args[at..].iter().map(|a| quote(a)));
    Some(format!(
        "unknown command '{word}'; to trace it: {}",
        suggestion.join(" ")
    ))
}

/// Whether `arg` is an option (`--top`, `-p`) that takes a value.
fn takes_value(cmd: &clap::Command, arg: &str) -> bool {
    let matches = |a: &&clap::Arg| {
        if let Some(long) = arg.strip_prefix("--") {
            a.get_long() == Some(long)
        } else if let Some(short) = arg.strip_prefix('-') {
            let mut chars = short.chars();
            matches!((chars.next(), chars.next()), (Some(c), None) if a.get_short() == Some(c))
        } else {
            false
        }
    };
    cmd.get_arguments()
        .find(matches)
        .is_some_and(|a| a.get_action().takes_values())
}

/// `arg` as a shell reads it back: single-quoted when it holds anything
/// but letters, digits and `-_./=:,+@%`.
fn quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn hint_of(args: &[&str]) -> Option<String> {
        let mut all = vec!["mtrace"];
        all.extend_from_slice(args);
        let e = Cli::try_parse_from(&all).expect_err("a usage error");
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        hint(&e, &args)
    }

    #[test]
    fn a_command_without_dashes_is_suggested_with_them() {
        assert_eq!(
            hint_of(&["ls"]).as_deref(),
            Some("unknown command 'ls'; to trace it: mtrace -- ls")
        );
        assert_eq!(
            hint_of(&["--top", "5", "ls", "-l", "a b"]).as_deref(),
            Some("unknown command 'ls'; to trace it: mtrace --top 5 -- ls -l 'a b'")
        );
        // An option's value equal to the word is not where it was met.
        assert_eq!(
            hint_of(&["--snapshot-dir", "ls", "ls"]).as_deref(),
            Some("unknown command 'ls'; to trace it: mtrace --snapshot-dir ls -- ls")
        );
        assert_eq!(hint_of(&["--nope"]), None);
        assert_eq!(hint_of(&["report", "a.json", "b.json"]), None);
    }
}
