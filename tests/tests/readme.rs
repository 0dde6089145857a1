//! The README's examples print what the README says they print (issue 18).
//!
//! Every ```` ```console ```` block of README.md is a transcript: a line
//! `$ meshctl generate …` (or `$ target/release/meshctl generate …`) is a
//! command, the lines after it up to the next `$` line are what the terminal
//! shows. Its last line, when it is `[…]`, is the summary meshctl writes to
//! stderr; the others are the reply on stdout. Each command runs, as written,
//! against a mesh of the real default model (greedy decoding is
//! deterministic) and its reply must be exactly the transcript's; of the
//! summary, the finish reason and the token counts must be (the worker's name
//! and the timings vary). The mesh is plaintext here, so the commands run
//! with `TOKENMESH_INSECURE`, where a newcomer's `scripts/up.sh` mesh gives
//! meshctl its development certificates.
use std::path::PathBuf;
use std::process::Command;
use tokenmesh_tests::*;

/// One command of a transcript and what it should print.
#[derive(Debug)]
struct Example {
    /// The command's words after `meshctl`.
    args: Vec<String>,
    /// The reply on stdout, lines joined with newlines.
    stdout: String,
    /// The summary line on stderr, if the transcript shows it.
    summary: Option<String>,
    /// Where the command is, for failure messages.
    line: usize,
}

/// The words of a shell command line: blanks separate, '…' and "…" quote
/// (with \" and \\ inside double quotes).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => out.extend(word.take()),
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                w.extend(chars.by_ref().take_while(|&c| c != '\''));
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => w.extend(chars.next()),
                        c => w.push(c),
                    }
                }
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    out.extend(word);
    out
}

/// Every `console` block's commands in `readme`.
fn examples(readme: &str) -> Vec<Example> {
    let mut out: Vec<Example> = Vec::new();
    let mut output: Vec<&str> = Vec::new();
    let mut in_console = false;
    let finish = |out: &mut Vec<Example>, output: &mut Vec<&str>| {
        let Some(ex) = out.last_mut() else {
            assert!(output.is_empty(), "output before any command: {output:?}");
            return;
        };
        if let Some(last) = output
            .last()
            .filter(|l| l.starts_with('[') && l.ends_with(']'))
        {
            ex.summary = Some(last.to_string());
            output.pop();
        }
        ex.stdout = output.join("\n");
        output.clear();
    };
    for (i, line) in readme.lines().enumerate() {
        if !in_console {
            in_console = line.trim() == "```console";
            continue;
        }
        if line.trim() == "```" {
            finish(&mut out, &mut output);
            in_console = false;
            continue;
        }
        match line.strip_prefix("$ ") {
            Some(command) => {
                finish(&mut out, &mut output);
                let mut w = words(command);
                let program = w.first().cloned().unwrap_or_default();
                assert!(
                    program == "meshctl" || program.ends_with("/meshctl"),
                    "README.md:{}: console blocks hold meshctl commands, not {program:?}",
                    i + 1
                );
                w.remove(0);
                out.push(Example {
                    args: w,
                    stdout: String::new(),
                    summary: None,
                    line: i + 1,
                });
            }
            None => output.push(line),
        }
    }
    out
}

/// The summary up to the worker's name: finish reason and token counts.
fn summary_head(summary: &str) -> &str {
    summary.split("; worker ").next().unwrap_or(summary)
}

#[test]
fn transcripts_are_parsed_as_documented() {
    let readme = "text\n```console\n$ target/release/meshctl generate \"A b?\" --x 'c d'\nline 1\n\nline 3\n[eos; 1 prompt + 2 completion tokens; worker w (v1); first token 1 ms, total 2 ms]\n$ meshctl generate hi\nhello\n```\n```sh\n$ not a transcript\n```\n";
    let ex = examples(readme);
    assert_eq!(ex.len(), 2, "{ex:?}");
    assert_eq!(ex[0].args, ["generate", "A b?", "--x", "c d"]);
    assert_eq!(ex[0].stdout, "line 1\n\nline 3");
    assert_eq!(
        summary_head(ex[0].summary.as_deref().unwrap()),
        "[eos; 1 prompt + 2 completion tokens"
    );
    assert_eq!(ex[1].args, ["generate", "hi"]);
    assert_eq!(ex[1].stdout, "hello");
    assert_eq!(ex[1].summary, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_readme_s_meshctl_examples_print_what_it_shows() {
    let readme_path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let examples = examples(&readme);
    assert!(
        examples
            .iter()
            .filter(|e| e.args.first().map(String::as_str) == Some("generate"))
            .count()
            >= 2,
        "README.md has no meshctl generate transcripts: {examples:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let worker = real_worker("worker-1", &[], dir.path()).await;
    let router = static_router(dir.path(), &[&worker], &[]).await;
    let router_addr = router.addr.trim_start_matches("http://").to_string();
    let mut failures = Vec::new();
    for ex in &examples {
        let out = Command::new(bin("meshctl"))
            .args(&ex.args)
            .env("TOKENMESH_ROUTER", &router_addr)
            .env("TOKENMESH_INSECURE", "true")
            .env_remove("TOKENMESH_TLS_DIR")
            .output()
            .expect("running meshctl");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let place = format!("README.md:{} `meshctl {}`", ex.line, ex.args.join(" "));
        if !out.status.success() {
            failures.push(format!("{place}: exit {:?}\n{stderr}", out.status));
            continue;
        }
        // meshctl ends the reply with a newline.
        let reply = stdout.strip_suffix('\n').unwrap_or(&stdout);
        if reply != ex.stdout {
            failures.push(format!(
                "{place}: the README shows\n{}\nbut it prints\n{reply}",
                ex.stdout
            ));
        }
        if let Some(summary) = &ex.summary {
            let printed = stderr.lines().last().unwrap_or_default();
            if summary_head(printed) != summary_head(summary) {
                failures.push(format!(
                    "{place}: the README shows the summary\n{summary}\nbut it prints\n{printed}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
