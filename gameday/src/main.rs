//! `understudy-gameday`: game days and the policy simulator.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use understudy_api::crd::FailoverPolicy;
use understudy_gameday::simulate::report::Report;
use understudy_gameday::simulate::{self, Rules, Schedule};

#[derive(Debug, Parser)]
#[command(name = "understudy-gameday", version, about = "Game days for understudy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a failure schedule through the real failover state machine and print what would happen.
    Simulate {
        /// The schedule: rounds, replica A's faults, and the policy (see examples/schedules/).
        schedule: PathBuf,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
        /// Run the schedule once per promote_after value in this range (like `1..=4`) and print a table.
        #[arg(long, value_name = "FIRST..=LAST", value_parser = parse_range)]
        sweep: Option<(u32, u32)>,
        /// Run under this FailoverPolicy manifest instead of the schedule's own policy: a round
        /// lasts its probe interval and its generating probes are the check.
        #[arg(long, value_name = "FAILOVERPOLICY.yaml")]
        policy: Option<PathBuf>,
        /// With --policy: rounds a promotion takes from decision to serving.
        #[arg(long, default_value_t = 1, requires = "policy")]
        promotion_rounds: u32,
    },
}

fn parse_range(text: &str) -> Result<(u32, u32), String> {
    let (first, last) = text
        .split_once("..=")
        .ok_or("expected FIRST..=LAST, like 1..=4")?;
    let parse = |s: &str| s.trim().parse::<u32>().map_err(|e| format!("{s:?}: {e}"));
    let (first, last) = (parse(first)?, parse(last)?);
    if first == 0 || first > last {
        return Err(format!("empty or zero range {first}..={last}"));
    }
    Ok((first, last))
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Simulate {
            schedule: path,
            json,
            sweep,
            policy,
            promotion_rounds,
        } => {
            let schedule =
                Schedule::from_yaml(&read(&path)?).with_context(|| format!("in {}", path.display()))?;
            let rules = match policy {
                Some(policy_path) => {
                    let manifest: FailoverPolicy =
                        serde_yaml::from_str(&read(&policy_path)?).with_context(|| {
                            format!("reading a FailoverPolicy from {}", policy_path.display())
                        })?;
                    Rules::from_failover_policy(&manifest.spec, promotion_rounds)
                        .with_context(|| format!("in {}", policy_path.display()))?
                }
                None => {
                    let own = schedule
                        .policy
                        .as_ref()
                        .ok_or(simulate::ScheduleError::NoPolicy)?;
                    Rules::from_schedule(own)
                }
            };
            let report = match sweep {
                None => Report::single(&schedule, &rules),
                Some((first, last)) => Report::sweep(&schedule, &rules, first..=last),
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.render());
            }
            Ok(())
        }
    }
}
