//! The work tree explains itself to someone who clones it: no file refers to a tracker's
//! numbered entries, to documents that do not ship, or to who wrote what. Each word below is
//! spelled in pieces so that this file passes its own check.

use std::process::Command;

use crate::helpers::repo_root;

/// Phrases that only mean something to someone who saw how the project was planned, matched
/// as whole words, case-insensitively.
fn phrases() -> Vec<String> {
    Vec::from([
        ["iss", "ue"].concat(),
        ["iss", "ues"].concat(),
        ["cla", "im"].concat(),
        ["cla", "ims"].concat(),
        ["the s", "pec"].concat(),
        ["s", "pec.md"].concat(),
        ["s", "pec §"].concat(),
        ["do", "ne when"].concat(),
        ["do", "ne-when"].concat(),
        ["this ro", "und"].concat(),
        ["ro", "und's"].concat(),
        ["ses", "sion"].concat(),
        ["original cl", "ass"].concat(),
        ["config-", "wing"].concat(),
        ["config w", "ing"].concat(),
        ["original mod", "ule"].concat(),
        ["added by s", "weep"].concat(),
    ])
}

/// Files whose words are not the project's: licences, and third-party data with its
/// attribution.
fn third_party(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("LICENSE")
        || name.ends_with(".LICENSE.txt")
        || path.starts_with("data/")
        || path.starts_with("tests/fixtures/shared/traces/")
        || name == "Cargo.lock"
        || name == "package-lock.json"
}

/// Letters and digits continue a word; `_` does not, so that identifiers such as
/// `x_example` are checked word by word.
fn is_word(c: char) -> bool {
    c.is_alphanumeric()
}

/// The phrases `line` holds as whole words.
fn hits(line: &str, phrases: &[String]) -> Vec<String> {
    let lower = line.to_lowercase();
    phrases
        .iter()
        .filter(|p| {
            lower.match_indices(p.as_str()).any(|(i, _)| {
                let before = lower[..i].chars().next_back();
                let after = lower[i + p.len()..].chars().next();
                !before.is_some_and(is_word) && !after.is_some_and(is_word)
            })
        })
        .cloned()
        .collect()
}

#[test]
fn no_tracked_file_uses_words_only_an_insider_knows() {
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(repo_root())
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "`git ls-files` failed in {}: this check needs the clone's git metadata: {}",
        repo_root().display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let phrases = phrases();
    let mut found = Vec::new();
    let mut checked = 0;
    for path in String::from_utf8(out.stdout).unwrap().split('\0') {
        if path.is_empty() || third_party(path) {
            continue;
        }
        // Binary files (images, fonts) and files removed from the work tree have no lines.
        let Ok(text) = std::fs::read_to_string(repo_root().join(path)) else {
            continue;
        };
        checked += 1;
        for (i, line) in text.lines().enumerate() {
            for p in hits(line, &phrases) {
                found.push(format!("{path}:{}: `{p}`: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(checked > 100, "only {checked} files checked");
    assert!(
        found.is_empty(),
        "reword these so that they explain themselves to a reader of the clone:\n{}",
        found.join("\n")
    );
}

#[test]
fn phrases_match_as_whole_words_in_any_case() {
    let phrases = phrases();
    let word = ["Iss", "ue"].concat();
    assert_eq!(hits(&format!("see {word} 22."), &phrases).len(), 1);
    assert!(hits(&format!("{word}d a warning"), &phrases).is_empty());
    assert!(hits("a round trip, round(x), rounded", &phrases).is_empty());
    assert!(hits("speculation and respecting", &phrases).is_empty());
    assert_eq!(hits(&format!("def {word}_example():"), &phrases).len(), 1);
    assert!(third_party("data/traces/x.csv") && third_party("LICENSE"));
    assert!(!third_party("docs/failures.md"));
}
