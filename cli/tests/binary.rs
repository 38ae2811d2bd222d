//! The `kubectl-understudy` binary over a real socket: a kubeconfig naming a loopback API server
//! that answers with the recorded policy and writes down the patches it is sent. What kubectl
//! would do with a kubeconfig, the namespace, the output formats, and a change only after a yes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

const CLI: &str = env!("CARGO_BIN_EXE_kubectl-understudy");
const POLICY: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama";

/// One request: its line and its body.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// Serves the recorded policy at its path and as the namespace's list, and takes patches.
fn api_server() -> (u16, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let policy = std::fs::read_to_string(format!(
        "{}/tests/fixtures/llama-after-failover.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let mut length = 0;
            loop {
                let mut header = String::new();
                reader.read_line(&mut header).unwrap();
                if header.trim().is_empty() {
                    break;
                }
                if let Some((name, value)) = header.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    length = value.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let request = line.trim().to_owned();
            log.lock()
                .unwrap()
                .push((request.clone(), String::from_utf8(body).unwrap()));
            let path = request
                .split(' ')
                .nth(1)
                .unwrap_or_default()
                .split('?')
                .next()
                .unwrap_or_default();
            let (status, answer) = match path {
                POLICY => ("200 OK", policy.clone()),
                "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies" => (
                    "200 OK",
                    format!(r#"{{"apiVersion":"understudy.dev/v1alpha1","kind":"FailoverPolicyList","metadata":{{}},"items":[{policy}]}}"#),
                ),
                _ => ("404 Not Found", r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":404,"reason":"NotFound","message":"not found"}"#.to_owned()),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (port, seen)
}

fn kubeconfig(dir: &tempfile::TempDir, port: u16) -> String {
    let path = dir.path().join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: loop, cluster: {{server: \"http://127.0.0.1:{port}\"}}}}]\n\
             users: [{{name: me, user: {{token: t0ken}}}}]\n\
             contexts: [{{name: other, context: {{cluster: loop, user: me, namespace: elsewhere}}}},\n\
             {{name: serving, context: {{cluster: loop, user: me, namespace: serving}}}}]\n\
             current-context: other\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

fn cli(kubeconfig: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(CLI)
        .args(["--kubeconfig", kubeconfig, "--context", "serving"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

#[test]
fn it_reads_in_the_contexts_namespace_and_prints_tables_json_and_yaml() {
    let (port, seen) = api_server();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(&dir, port);
    let table = stdout(&cli(&kubeconfig, &["get"], ""));
    assert!(table.contains("llama   us-west   1       Serving"), "{table}");
    let json: serde_json::Value = serde_json::from_str(&stdout(&cli(
        &kubeconfig,
        &["coldstart", "llama", "-o", "json"],
        "",
    )))
    .unwrap();
    assert_eq!(json["coldStart"].as_array().unwrap().len(), 6);
    let yaml = stdout(&cli(&kubeconfig, &["describe", "llama", "-o", "yaml"], ""));
    assert!(yaml.contains("primaryPool: us-west"), "{yaml}");
    let requests: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(line, _)| line.clone())
        .collect();
    assert!(
        requests[0].starts_with("GET /apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies?"),
        "{requests:?}"
    );
    assert!(
        requests[1..]
            .iter()
            .all(|r| r.starts_with(&format!("GET {POLICY} "))),
        "{requests:?}"
    );
}

#[test]
fn a_change_is_written_only_after_a_yes_and_a_missing_policy_is_a_clear_error() {
    let (port, seen) = api_server();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(&dir, port);
    let declined = cli(&kubeconfig, &["pause", "llama"], "n\n");
    assert!(!declined.status.success());
    let said = String::from_utf8_lossy(&declined.stderr);
    assert!(
        said.contains("Pause llama?") && said.contains("nothing was changed"),
        "{said}"
    );
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|(line, _)| line.starts_with("GET "))
    );

    let done = stdout(&cli(&kubeconfig, &["failback", "llama"], "yes\n"));
    assert!(done.starts_with("Asked llama to fail back to us-east"), "{done}");
    let (line, body) = seen.lock().unwrap().last().cloned().unwrap();
    assert!(line.starts_with(&format!("PATCH {POLICY}?")), "{line}");
    assert!(line.contains("fieldManager=kubectl-understudy"), "{line}");
    let patch: serde_json::Value = serde_json::from_str(&body).unwrap();
    let command = patch["metadata"]["annotations"]["understudy.dev/command"]
        .as_str()
        .unwrap();
    assert!(command.starts_with("failback@cli-"), "{command}");

    let missing = cli(&kubeconfig, &["describe", "nope"], "");
    assert!(!missing.status.success());
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(said.starts_with("error: reading FailoverPolicy nope"), "{said}");
}
