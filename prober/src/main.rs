//! `understudy-prober`: one round of generating probes, or a cold-start stage table, from the
//! command line, without the operator.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::time::Duration;

use understudy_prober::coldstart;
use understudy_prober::outcome::pool_verdict;
use understudy_prober::probe::{self, Budget, Endpoint, Expectation, ProbeSpec};

#[derive(Debug, Parser)]
#[command(
    name = "understudy-prober",
    about = "Probe vLLM replicas and time their cold starts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn go_duration(text: &str) -> Result<Duration, String> {
    understudy_core::duration::parse(text).map_err(|e| e.to_string())
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Probe each endpoint once with a deterministic streamed completion and print the outcomes.
    Probe {
        /// Replica endpoints, `http://HOST:PORT`.
        #[arg(required = true)]
        endpoints: Vec<Endpoint>,
        /// The golden answer's prefix the text must start with.
        #[arg(long, conflicts_with = "expect_regex")]
        expect_prefix: Option<String>,
        /// A regular expression the text must match.
        #[arg(long)]
        expect_regex: Option<regex::Regex>,
        /// The served model name (default: the server's only model).
        #[arg(long)]
        model: Option<String>,
        #[arg(long, default_value = "The capital of France is")]
        prompt: String,
        #[arg(long, default_value_t = 8)]
        max_tokens: u32,
        #[arg(long, default_value_t = 1234)]
        seed: u64,
        #[arg(long, default_value = "10s", value_parser = go_duration)]
        timeout: Duration,
        #[arg(long, default_value = "2s", value_parser = go_duration)]
        first_token_budget: Duration,
        #[arg(long, default_value = "5s", value_parser = go_duration)]
        total_budget: Duration,
        #[arg(long, default_value = "3s", value_parser = go_duration)]
        stall_after: Duration,
        /// How many replicas must pass for the pool to pass.
        #[arg(long, default_value_t = 1)]
        min_serving: usize,
        /// Spread the probes over this long (seeded jitter); 0s probes all at once.
        #[arg(long, default_value = "0s", value_parser = go_duration)]
        jitter: Duration,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Print a replica's cold-start stage table from its pod, events and container log.
    Coldstart {
        /// `kubectl get pod NAME -o json`
        #[arg(long)]
        pod: PathBuf,
        /// `kubectl get events --field-selector involvedObject.name=NAME -o json`
        #[arg(long)]
        events: Option<PathBuf>,
        /// `kubectl logs NAME -c vllm --timestamps`
        #[arg(long)]
        logs: Option<PathBuf>,
        /// The serving container (default: the pod's first).
        #[arg(long)]
        container: Option<String>,
        /// When the first successful generating probe got its first token (RFC 3339).
        #[arg(long)]
        first_token: Option<jiff::Timestamp>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
}

fn read(path: &PathBuf) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Probe {
            endpoints,
            expect_prefix,
            expect_regex,
            model,
            prompt,
            max_tokens,
            seed,
            timeout,
            first_token_budget,
            total_budget,
            stall_after,
            min_serving,
            jitter,
            json,
        } => {
            let expect = match (expect_prefix, expect_regex) {
                (Some(prefix), _) => Expectation::Prefix(prefix),
                (None, Some(regex)) => Expectation::Regex(regex),
                (None, None) => Expectation::NonEmpty,
            };
            let spec = ProbeSpec {
                model,
                prompt,
                max_tokens,
                seed,
                expect,
                budget: Budget {
                    first_token: first_token_budget,
                    total: total_budget,
                },
                timeout,
                stall_after,
                check_sleep: true,
            };
            let reports = probe::probe_round(&endpoints, &spec, seed, 0, jitter).await;
            let outcomes: Vec<_> = reports.iter().map(|r| r.outcome.clone()).collect();
            let verdict = pool_verdict(&outcomes, min_serving);
            if json {
                let doc = serde_json::json!({"reports": reports, "pool": format!("{verdict:?}")});
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else {
                print!("{}", probe::render_table(&reports));
                println!("pool (min serving {min_serving}): {verdict:?}");
            }
        }
        Command::Coldstart {
            pod,
            events,
            logs,
            container,
            first_token,
            json,
        } => {
            let pod = coldstart::parse_pod(&read(&pod)?)?;
            let events = match &events {
                Some(path) => coldstart::parse_events(&read(path)?)?,
                None => Vec::new(),
            };
            let log = match &logs {
                Some(path) => read(path)?,
                None => String::new(),
            };
            let timeline = coldstart::build(&coldstart::ColdStartInputs {
                pod: &pod,
                events: &events,
                log: &log,
                container: container.as_deref(),
                first_token,
            });
            if json {
                println!("{}", serde_json::to_string_pretty(&timeline)?);
            } else {
                print!("{}", coldstart::render_table(&timeline));
            }
        }
    }
    Ok(())
}
