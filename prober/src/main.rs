//! `understudy-prober`: cold-start stage tables from the command line.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use understudy_prober::coldstart;

#[derive(Debug, Parser)]
#[command(
    name = "understudy-prober",
    about = "Probe vLLM replicas and time their cold starts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
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
