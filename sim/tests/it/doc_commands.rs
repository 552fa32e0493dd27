//! The README and `docs/` as a newcomer reads them: every command block says whether it runs
//! as written, the runnable ones do (from the clone's root, and the binary's own commands from
//! another directory too), every relative link and anchor resolves, and the README stays short.
//! The conventions are in `docs/testing.md#commands-in-the-docs`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::helpers::repo_root;

/// The README's size limit: the tour, not the reference.
const README_MAX_BYTES: usize = 12 * 1024;
/// A guide's size limit: a page a newcomer reads in minutes (reference material long by nature
/// is split into pages; measurements live in dated `results/` files).
const GUIDE_MAX_BYTES: usize = 16 * 1024;
/// The info-string languages of command blocks.
const SHELLS: [&str; 5] = ["sh", "bash", "shell", "console", "zsh"];
/// A runnable block's bound on its run, generous for a debug build on a loaded machine.
const BLOCK_SECS: u64 = 600;

/// One fenced block of a markdown file.
#[derive(Debug)]
struct Block {
    /// `file:line` of the opening fence.
    at: String,
    /// The info string's words after the language.
    marks: Vec<String>,
    lang: String,
    body: String,
}

/// The markdown files the conventions cover: the README, the engine's, the Python package's and
/// the dashboards' READMEs, and every page under `docs/`.
fn pages() -> Vec<PathBuf> {
    let root = repo_root();
    let mut pages: Vec<PathBuf> = [
        "README.md",
        "engine/README.md",
        "python/README.md",
        "dashboards/README.md",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

fn rel(path: &Path) -> String {
    path.strip_prefix(repo_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The fenced blocks of `text` (fences at the start of a line, as every page writes them).
fn blocks(file: &str, text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        let Some(info) = line.strip_prefix("```") else {
            if let Some(b) = open.as_mut() {
                b.body.push_str(line);
                b.body.push('\n');
            }
            continue;
        };
        match open.take() {
            Some(b) => out.push(b),
            None => {
                let mut words = info.split([' ', ',']).filter(|w| !w.is_empty());
                open = Some(Block {
                    at: format!("{file}:{}", i + 1),
                    lang: words.next().unwrap_or_default().to_owned(),
                    marks: words.map(str::to_owned).collect(),
                    body: String::new(),
                });
            }
        }
    }
    assert!(open.is_none(), "{file}: a fence is never closed");
    out
}

/// How a command block is marked.
#[derive(Debug, PartialEq)]
enum Mark {
    /// Run by hand only (it needs a server, `make`, an input of the reader's own, or hours).
    Manual,
    /// Run by this test; `requests`: the bound appended to `replay` and `sweep` commands.
    Runnable { requests: Option<u32> },
}

fn mark(b: &Block) -> Result<Mark, String> {
    let mut runnable = None;
    let mut requests = None;
    for m in &b.marks {
        match m.as_str() {
            "manual" => runnable = Some(false),
            "runnable" => runnable = Some(true),
            _ => match m.strip_prefix("requests:").map(str::parse::<u32>) {
                Some(Ok(n)) if n > 0 => requests = Some(n),
                _ => return Err(format!("{}: unknown mark `{m}`", b.at)),
            },
        }
    }
    match (runnable, requests) {
        (Some(true), requests) => Ok(Mark::Runnable { requests }),
        (Some(false), None) => Ok(Mark::Manual),
        (Some(false), Some(_)) => Err(format!("{}: `requests:N` on a manual block", b.at)),
        (None, _) => Err(format!(
            "{}: a command block is marked `runnable` or `manual` (```{} runnable)",
            b.at, b.lang
        )),
    }
}

/// Every command block of the README and `docs/`, with its mark.
fn command_blocks() -> Vec<(Block, Mark)> {
    let mut problems = Vec::new();
    let mut out = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page is UTF-8");
        for b in blocks(&rel(&page), &text) {
            if !SHELLS.contains(&b.lang.as_str()) {
                continue;
            }
            match mark(&b) {
                Ok(m) => out.push((b, m)),
                Err(e) => problems.push(e),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    out
}

/// The block's commands, one per logical line (continuations joined, comments and blank lines
/// dropped), when every one is the binary's: those also run from another directory.
fn binary_commands(body: &str) -> Option<Vec<String>> {
    let joined = body.replace("\\\n", " ");
    let mut out = Vec::new();
    for line in joined.lines() {
        let line = line.split(" #").next().unwrap_or_default().trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !line.starts_with("mstar-chunking ") || line.contains(['\'', '"', '<', '>', '|', '$']) {
            return None;
        }
        out.push(line.to_owned());
    }
    (!out.is_empty()).then_some(out)
}

/// A directory whose entries are links to the clone's top-level entries (not `target/` or
/// `.git`): paths resolve as from the clone's root, and what a command writes stays out of it.
fn root_view() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(repo_root()).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        std::os::unix::fs::symlink(e.path(), dir.path().join(&name)).unwrap();
    }
    dir
}

/// A `bin/` with `mstar-chunking`: the test build of the binary, which appends
/// `--requests N` to a `replay` or `sweep` that names none when the block is bounded.
fn wrapper(dir: &Path, requests: Option<u32>) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = env!("CARGO_BIN_EXE_mstar-chunking");
    let bound = match requests {
        Some(n) => format!(
            "case \"$1\" in replay|sweep) case \" $* \" in *\" --requests\"*) ;; \
             *) set -- \"$@\" --requests {n} ;; esac ;; esac\n"
        ),
        None => String::new(),
    };
    let script = bin.join("mstar-chunking");
    std::fs::write(&script, format!("#!/bin/sh\n{bound}exec '{real}' \"$@\"\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// Runs `cmd` under `timeout` (which signals its whole process group) with only `PATH` and
/// `HOME` from the test's environment, so a developer's `MSTAR__…` variables change nothing.
/// Answers its stdout, or what went wrong.
fn run_bounded(mut cmd: Command, bin: &Path, at: &str) -> Result<String, String> {
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    cmd.env_clear().env("PATH", path);
    if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    let out = cmd
        .output()
        .map_err(|e| format!("{at}: cannot run `timeout`: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    match out.status.success() {
        true => Ok(stdout),
        false => Err(format!(
            "{at}: the block failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

fn bounded(program: &str) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "10", &BLOCK_SECS.to_string(), program]);
    cmd
}

/// `args` with every relative path that names something in the clone made absolute.
fn absolute_paths(args: &str) -> Vec<String> {
    args.split_whitespace()
        .map(|a| {
            let p = repo_root().join(a);
            match !a.starts_with('-') && !a.starts_with('/') && p.exists() {
                true => p.display().to_string(),
                false => a.to_owned(),
            }
        })
        .collect()
}

/// Runs one runnable block from the root's view, then, if it is the binary's commands only,
/// each command from an empty directory.
fn run_block(b: &Block, requests: Option<u32>) -> Result<(), String> {
    let started = std::time::Instant::now();
    let view = root_view();
    let scratch = tempfile::tempdir().unwrap();
    let bin = wrapper(scratch.path(), requests);
    let mut cmd = bounded("bash");
    cmd.args(["-euo", "pipefail", "-c", &b.body])
        .current_dir(view.path());
    let stdout = run_bounded(cmd, &bin, &b.at)?;
    if stdout.trim().is_empty() {
        return Err(format!("{}: printed nothing", b.at));
    }
    if let Some(commands) = binary_commands(&b.body) {
        let elsewhere = tempfile::tempdir().unwrap();
        for c in commands {
            let args = absolute_paths(c.trim_start_matches("mstar-chunking "));
            let mut cmd = bounded("mstar-chunking");
            cmd.args(&args).current_dir(elsewhere.path());
            run_bounded(cmd, &bin, &format!("{} (from another directory)", b.at))?;
        }
    }
    eprintln!("{}: ran in {:.1} s", b.at, started.elapsed().as_secs_f64());
    Ok(())
}

#[test]
fn runnable_command_blocks_run_from_the_root_and_the_binarys_from_elsewhere() {
    let runnable: Vec<(Block, Option<u32>)> = command_blocks()
        .into_iter()
        .filter_map(|(b, m)| match m {
            Mark::Runnable { requests } => Some((b, requests)),
            Mark::Manual => None,
        })
        .collect();
    assert!(
        runnable.len() >= 5,
        "only {} runnable blocks",
        runnable.len()
    );
    // The blocks are independent: a few at a time, each its own processes and directories.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((b, requests)) = runnable.get(i) else {
                    break;
                };
                if let Err(e) = run_block(b, *requests) {
                    failures.lock().unwrap().push(e);
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_command_block_is_marked() {
    let blocks = command_blocks();
    assert!(blocks.iter().any(|(_, m)| *m == Mark::Manual));
    let bad = Block {
        at: "x.md:1".into(),
        lang: "sh".into(),
        marks: vec![],
        body: String::new(),
    };
    assert!(mark(&bad).unwrap_err().contains("x.md:1"));
}

#[test]
fn binary_commands_join_continuations_and_keep_out_shell() {
    let body = "mstar-chunking replay --trace t.csv \\\n  --budget 512   # a comment\n\n# only a comment\nmstar-chunking check\n";
    assert_eq!(
        binary_commands(body).unwrap(),
        vec![
            "mstar-chunking replay --trace t.csv    --budget 512",
            "mstar-chunking check"
        ]
    );
    assert_eq!(binary_commands("python3 check.py steps.jsonl\n"), None);
    assert_eq!(binary_commands("mstar-chunking replay > out.txt\n"), None);
}

#[test]
fn every_guide_is_a_page_read_in_minutes() {
    let root = repo_root();
    let mut guides = pages();
    for dir in ["docs/decisions", "engine", "python"] {
        let mut more: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .expect("a guides directory is readable")
            .map(|e| e.expect("an entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        more.sort();
        guides.extend(more);
    }
    guides.sort();
    guides.dedup();
    assert!(guides.len() > 40, "{guides:?}");
    let long: Vec<String> = guides
        .iter()
        .filter_map(|p| {
            let n = std::fs::metadata(p).unwrap().len() as usize;
            (n > GUIDE_MAX_BYTES).then(|| format!("{} is {n} bytes", rel(p)))
        })
        .collect();
    assert!(
        long.is_empty(),
        "guides over {GUIDE_MAX_BYTES} bytes (split them, or move figures to results/): {long:?}"
    );
}

#[test]
fn the_readme_is_short() {
    let n = std::fs::metadata(repo_root().join("README.md"))
        .unwrap()
        .len() as usize;
    assert!(
        n <= README_MAX_BYTES,
        "README.md is {n} bytes; at most {README_MAX_BYTES}: move reference material to docs/"
    );
}

#[test]
fn the_readmes_first_code_block_is_the_doc_tested_engine_loop() {
    let text = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let first = blocks("README.md", &text)
        .into_iter()
        .next()
        .expect("README.md has a code block");
    assert_eq!(
        first.lang, "rust",
        "{}: the first block is not Rust",
        first.at
    );
    assert!(
        first.marks.is_empty(),
        "{}: the first block is not a plain (doc-tested) Rust block: {:?}",
        first.at,
        first.marks
    );
    for needle in [
        "start_on_own_thread",
        "complete_and_assemble(",
        "is_final",
        "max_step_ms",
    ] {
        assert!(
            first.body.contains(needle),
            "{}: the engine loop does not show `{needle}`",
            first.at
        );
    }
}

/// GitHub's anchor for a heading: lower case, spaces as `-`, punctuation other than `-` and
/// `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_lowercase().next()?),
            _ => None,
        })
        .collect()
}

/// The anchors of a markdown file's headings (outside code blocks), repeats numbered.
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let h = line.trim_start_matches('#');
        if in_code || h.len() == line.len() || !h.starts_with(' ') {
            continue;
        }
        let a = anchor(h);
        let n = seen.iter().filter(|x| **x == a).count();
        out.push(match n {
            0 => a.clone(),
            n => format!("{a}-{n}"),
        });
        seen.push(a);
    }
    out
}

/// The relative link targets of a markdown line: `[..](target)` outside code spans.
fn link_targets(line: &str) -> Vec<String> {
    let mut plain = String::new();
    for (i, part) in line.split('`').enumerate() {
        if i % 2 == 0 {
            plain.push_str(part);
        }
    }
    plain
        .match_indices("](")
        .filter_map(|(i, _)| {
            let rest = &plain[i + 2..];
            let end = rest.find(')')?;
            let t = rest[..end].trim();
            let external = t.contains("://") || t.starts_with("mailto:");
            (!external && !t.is_empty()).then(|| t.to_owned())
        })
        .collect()
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut problems = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let mut in_code = false;
        for (i, line) in text.lines().enumerate() {
            if line.starts_with("```") {
                in_code = !in_code;
            }
            if in_code {
                continue;
            }
            for t in link_targets(line) {
                let (path, frag) = t.split_once('#').unwrap_or((&t, ""));
                let target = match path {
                    "" => page.clone(),
                    p => page.parent().unwrap().join(p),
                };
                let at = format!("{}:{}", rel(&page), i + 1);
                if !target.exists() {
                    problems.push(format!("{at}: `{t}`: no such file"));
                    continue;
                }
                if frag.is_empty() || target.extension().is_none_or(|e| e != "md") {
                    continue;
                }
                let body = std::fs::read_to_string(&target).unwrap();
                if !anchors(&body).iter().any(|a| a == frag) {
                    problems.push(format!("{at}: `{t}`: no heading with that anchor"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What is wrong with the doc citations in a message (an error's text, a command's stderr): a
/// rule cited by its number (`rule ` and a digit), or a `docs/<page>.md#<anchor>` whose page or
/// heading does not exist. A message says what was wrong on its own, and points to a page's
/// section only by the anchor of a heading.
pub(crate) fn citation_problems(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (i, m) in text.match_indices("rule ") {
        if text[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()) {
            let end = (i + 12).min(text.len());
            problems.push(format!("cites a rule by its number: {:?}", &text[i..end]));
        }
    }
    problems.extend(anchor_problems(text, false));
    problems
}

/// The `docs/<page>.md#<anchor>` citations in `text` whose page does not exist, or whose anchor
/// is no heading of the page (nor, with `ids`, an explicit `<a id="…">` there).
fn anchor_problems(text: &str, ids: bool) -> Vec<String> {
    let mut problems = Vec::new();
    for (i, _) in text.match_indices("docs/") {
        let rest = &text[i..];
        let Some(md) = rest.find(".md") else { continue };
        let page = &rest[..md + 3];
        if !page[5..md]
            .chars()
            .all(|c| c.is_alphanumeric() || "-_/".contains(c))
        {
            continue;
        }
        let Ok(body) = std::fs::read_to_string(repo_root().join(page)) else {
            problems.push(format!("`{page}`: no such page"));
            continue;
        };
        let Some(frag) = rest[md + 3..].strip_prefix('#') else {
            continue;
        };
        let frag: String = frag
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        let explicit = ids && body.contains(&format!("<a id=\"{frag}\">"));
        if !explicit && !anchors(&body).contains(&frag) {
            problems.push(format!("`{page}#{frag}`: no heading with that anchor"));
        }
    }
    problems
}

#[test]
fn every_rule_a_refusal_cites_is_a_heading_of_its_page_named_not_numbered() {
    use mstar_chunking::budget::Rule;
    for rule in Rule::ALL {
        let cited = rule.to_string();
        assert_eq!(cited, format!("{}#{}", rule.page(), rule.anchor()));
        let page = std::fs::read_to_string(repo_root().join(rule.page())).unwrap();
        let anchor = rule.anchor().to_owned();
        assert!(anchors(&page).contains(&anchor), "{cited}: no such heading");
        let problems = citation_problems(&format!("a refusal ({cited})"));
        assert!(problems.is_empty(), "{cited}: {problems:?}");
    }
    // The check can fail: a number, a missing heading, a missing page.
    assert_eq!(
        citation_problems("x (docs/budgets.md#refusals, rule 6)"),
        ["cites a rule by its number: \"rule 6)\""]
    );
    assert_eq!(
        citation_problems("see docs/budgets.md#no-such-heading."),
        ["`docs/budgets.md#no-such-heading`: no heading with that anchor"]
    );
    assert_eq!(
        citation_problems("see docs/nowhere.md#x"),
        ["`docs/nowhere.md`: no such page"]
    );
    assert!(citation_problems("docs/budgets.md#an-unknown-node; docs/vllm.md").is_empty());
    // An explicit anchor counts in the code's comments, not in a message.
    let stranded = "docs/failures.md#stranded-rows";
    assert!(anchor_problems(stranded, true).is_empty());
    assert_eq!(anchor_problems(stranded, false).len(), 1);
}

/// The files whose messages and comments cite the docs: the component's, the simulator's and
/// the engine's sources, the Python package and the tests.
fn cited_from() -> Vec<PathBuf> {
    let root = repo_root();
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = [
        "src",
        "sim/src",
        "engine/src",
        "python/src",
        "python/mstar_chunking",
        "tests",
        "sim/tests",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .extension()
                .is_some_and(|e| ["rs", "py", "toml"].iter().any(|x| e == *x))
            {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_doc_anchor_the_code_cites_resolves() {
    let files = cited_from();
    assert!(files.len() > 50, "{}", files.len());
    let mut problems = Vec::new();
    for file in files {
        // This file's own checks cite missing anchors on purpose.
        if file.ends_with("sim/tests/it/doc_commands.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for p in anchor_problems(&text, true) {
            problems.push(format!("{}: {p}", rel(&file)));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn anchors_follow_githubs_rule() {
    assert_eq!(
        anchor(" The summary, figure by figure"),
        "the-summary-figure-by-figure"
    );
    assert_eq!(anchor(" `assemble`"), "assemble");
    assert_eq!(
        anchor(" KV memory: admission, preemption"),
        "kv-memory-admission-preemption"
    );
    assert_eq!(anchors("# A\n```\n# not\n```\n## A\n"), ["a", "a-1"]);
    assert_eq!(
        link_targets("see [`x`](a.md#b), `[no](c.md)` and ![i](img/p.png) or [w](https://e.x)"),
        ["a.md#b", "img/p.png"]
    );
}
