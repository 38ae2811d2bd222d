//! `understudy-gameday`: game days and the policy simulator.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use understudy_api::crd::FailoverPolicy;
use understudy_core::recovery::StageTimes;
use understudy_gameday::local::replicas::Launcher;
use understudy_gameday::local::report::Verdict;
use understudy_gameday::local::scenario::{self, Scenario};
use understudy_gameday::local::{self, Progress, RunOptions};
use understudy_gameday::plan;
use understudy_gameday::simulate::report::Report;
use understudy_gameday::simulate::{self, Rules, Schedule};
use understudy_gameday::soak::{self, SoakConfig};

#[derive(Debug, Parser)]
#[command(name = "understudy-gameday", version, about = "Game days for understudy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a local game day: emulated pools as real processes behind fences and two routers, the
    /// failover logic the operator runs, open-loop load and the scenario's faults; then report.
    /// Exits 0 when every run passed, 1 when one failed, and 3 when none failed but one could
    /// not be judged because the machine was too loaded (its report says how late its timers
    /// fired).
    Run {
        /// The scenario (see examples/gamedays/local/); the default crashes a primary with a hot
        /// standby.
        scenario: Option<PathBuf>,
        /// Where the report goes; a new folder under gameday-report/ when not given.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Seeds the load's arrivals, prompts and lengths.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Run the scenario this many times, with seeds `seed`, `seed + 1`, …, and report each
        /// run beside the medians and ranges.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=20))]
        seeds: u64,
    },
    /// Soak the data path: mixed load through two gateway processes in front of emulated
    /// replicas, with a fault every so often (a replica killed, a replica stopped, a gateway
    /// restarted by SIGTERM); fails unless no request failed before reaching a replica and no cut
    /// answer looked finished.
    Soak {
        /// How long load runs (Go duration).
        #[arg(long, default_value = "10m", value_parser = parse_duration)]
        duration: std::time::Duration,
        /// A fault this often (Go duration).
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        fault_every: std::time::Duration,
        /// Requests a second; half of them stream.
        #[arg(long, default_value_t = 20.0)]
        rate: f64,
        /// Emulated replicas behind the gateways.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=16))]
        replicas: u32,
        /// The gateways' drain delay: how long a stopping gateway fails /ready and serves on.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        drain_delay: std::time::Duration,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Also write the report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The vLLM emulator, as `vllm-emulator` runs it: how a local game day starts its replicas.
    #[command(hide = true)]
    Emulator {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The router, as `understudy-router` runs it: how a local game day starts its gateways and
    /// fences.
    #[command(hide = true)]
    Router {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
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
    /// Time a policy's standby pool against its recovery objective: when each mix of tiers
    /// serves a quarter, half, three quarters and all of its capacity after a fault, and the mix
    /// that meets the objective holding the fewest GPUs.
    Plan {
        /// The FailoverPolicy manifest; its second pool is the one planned for.
        #[arg(long, value_name = "FAILOVERPOLICY.yaml")]
        policy: PathBuf,
        /// Measured stage times, which win over the policy's coldStartEstimates stage by stage: a
        /// JSON object like {"node": 420, "weightLoad": "65s"} (see examples/stages/).
        #[arg(long, value_name = "STAGES.json")]
        stages: Option<PathBuf>,
        /// GPUs each replica holds.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
        gpus_per_replica: u32,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
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

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    understudy_core::duration::parse(text).map_err(|e| format!("{text:?}: {e}"))
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
        Command::Run {
            scenario,
            out,
            seed,
            seeds,
        } => run_game_day(scenario.as_deref(), out, seed, seeds),
        Command::Soak {
            duration,
            fault_every,
            rate,
            replicas,
            drain_delay,
            seed,
            json,
        } => {
            let config = SoakConfig {
                duration,
                fault_every,
                rate,
                replicas: replicas as usize,
                drain_delay,
                seed,
                ..SoakConfig::default()
            };
            run_soak(&config, json.as_deref())
        }
        Command::Router { args } => {
            let argv = std::iter::once("understudy-router".into()).chain(args.into_iter().map(Into::into));
            understudy_router::cli::run(argv)
        }
        Command::Emulator { args } => {
            let code = understudy_emulator::run_to_exit(&args).context("emulator")?;
            std::process::exit(code);
        }
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
                    let manifest = read_policy(&policy_path)?;
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
        Command::Plan {
            policy,
            stages,
            gpus_per_replica,
            json,
        } => {
            let manifest = read_policy(&policy)?;
            let measured = match &stages {
                Some(path) => plan::stage_times_from_json(&read(path)?)
                    .with_context(|| format!("in {}", path.display()))?,
                None => StageTimes::new(),
            };
            let plan = plan::plan(&manifest.spec, &measured, gpus_per_replica)
                .with_context(|| format!("in {}", policy.display()))?;
            let text = if json {
                serde_json::to_string_pretty(&plan)? + "\n"
            } else {
                plan.render()
            };
            // Written rather than printed, so that a closed pipe (`| head`) is an error, not a panic.
            std::io::stdout()
                .write_all(text.as_bytes())
                .context("writing the plan to stdout")
        }
    }
}

/// A FailoverPolicy manifest, checked against the CRD's schema as kube-apiserver checks it, so
/// that a misspelt or misplaced field is refused rather than left out.
fn read_policy(path: &Path) -> anyhow::Result<FailoverPolicy> {
    understudy_api::schema::from_yaml(&read(path)?)
        .with_context(|| format!("reading a FailoverPolicy from {}", path.display()))
}

fn run_soak(config: &SoakConfig, json: Option<&Path>) -> anyhow::Result<()> {
    let (emulator, router) = launchers()?;
    eprintln!(
        "soaking for {:?}: {} replicas, two gateways, {} requests/s, a fault every {:?}",
        config.duration, config.replicas, config.rate, config.fault_every
    );
    let report = runtime()?.block_on(soak::run(&emulator, &router, config))?;
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report)? + "\n";
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", report.summary());
    anyhow::ensure!(report.passed(), "the soak failed");
    Ok(())
}

/// This binary, re-run as the emulator and as the router.
fn launchers() -> anyhow::Result<(Launcher, Launcher)> {
    let this = std::env::current_exe().context("finding this binary to start replicas with")?;
    let emulator = Launcher {
        program: this.clone(),
        prefix: vec!["emulator".to_owned()],
    };
    let router = Launcher {
        program: this,
        prefix: vec!["router".to_owned()],
    };
    Ok((emulator, router))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")
}

fn run_game_day(path: Option<&Path>, out: Option<PathBuf>, seed: u64, seeds: u64) -> anyhow::Result<()> {
    let text = match path {
        Some(path) => read(path)?,
        None => scenario::DEFAULT.to_owned(),
    };
    let shown = path.map_or("the default scenario".to_owned(), |p| p.display().to_string());
    let plan = Scenario::plan(&text).with_context(|| format!("in {shown}"))?;
    let out = out.unwrap_or_else(|| default_out(&plan.name));
    let (launcher, router) = launchers()?;
    let runtime = runtime()?;
    let mut runs = Vec::new();
    for checked in &plan.runs {
        let scenario = &checked.scenario;
        for seed in seed..seed + seeds {
            eprintln!(
                "running {} ({shown}, seed {seed}): {} replica(s) in pool a, {} in pool b, {:?}, {} s of load",
                scenario.name,
                scenario.pools.a.replicas,
                scenario.pools.b.replicas,
                scenario.topology,
                checked.duration.as_secs()
            );
            let options = RunOptions {
                launcher: launcher.clone(),
                router: router.clone(),
                seed,
                progress: Progress::for_stderr(),
            };
            runs.push(runtime.block_on(local::run(checked, &options))?);
        }
    }
    let report = local::report::Report {
        scenario: plan.name.clone(),
        runs,
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(out.join("report.json"), json + "\n").context("writing report.json")?;
    std::fs::write(out.join("report.md"), local::report::markdown(&report)).context("writing report.md")?;
    for run in &report.runs {
        let name = if report.runs.len() == 1 {
            "timeline.svg".to_owned()
        } else {
            format!("timeline-{}-{}.svg", file_safe(&run.name), run.seed)
        };
        let svg = local::timeline::svg(run, &run.records);
        std::fs::write(out.join(&name), svg).with_context(|| format!("writing {name}"))?;
    }
    match report.runs.as_slice() {
        [run] => print!("{}", local::report::summary(run)),
        runs => print!("{}", local::report::side_by_side(runs)),
    }
    println!("report: {}", out.display());
    let verdicts = || report.runs.iter().map(|r| r.verdict);
    if verdicts().any(|v| !matches!(v, Verdict::Passed | Verdict::Inconclusive)) {
        anyhow::bail!("the game day did not pass");
    }
    if verdicts().any(|v| v == Verdict::Inconclusive) {
        eprintln!(
            "the game day is inconclusive: the machine was too loaded to judge a run by (see its \
             scheduling lag); run it again on a quieter machine"
        );
        std::process::exit(INCONCLUSIVE);
    }
    Ok(())
}

/// The exit status of a game day that could not be judged: neither passed (0) nor failed (1).
const INCONCLUSIVE: i32 = 3;

/// A run's name as part of a file name: letters, digits and `-` only.
fn file_safe(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// `gameday-report/<name>-<unix seconds>`: a new folder for every run.
fn default_out(name: &str) -> PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PathBuf::from("gameday-report").join(format!("{name}-{stamp}"))
}
