//! `kubectl understudy` (`kubectl-understudy` on the PATH): read FailoverPolicies and GameDays,
//! and switch over, fail back, pause and resume, through the kubeconfig and context kubectl uses.

use std::io::{BufRead, Write};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;
use understudy_api::crd::{FailoverPolicy, GameDay};
use understudy_cli::act::{self, Change};
use understudy_cli::{Output, view};

/// Read and drive understudy's FailoverPolicies and GameDays.
#[derive(Debug, Parser)]
#[command(name = "kubectl-understudy", version)]
struct Args {
    /// The kubeconfig file; by default `$KUBECONFIG`, then `~/.kube/config`, then the pod's
    /// service account.
    #[arg(long, global = true)]
    kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context; by default its current one.
    #[arg(long, global = true)]
    context: Option<String>,
    /// The namespace; by default the context's.
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// How to print: table, json or yaml.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Policies with their primary, epoch, state and conditions.
    Get {
        /// In every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// A policy's pools, conditions, last failover step by step, standby proof and GPU reserve.
    Describe { policy: String },
    /// A policy's cold starts: each stage per replica, and per tier the median and the worst.
    Coldstart { policy: String },
    /// GameDays, their runs and verdicts.
    Gamedays {
        /// In every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// Make POOL the policy's primary.
    Switchover {
        policy: String,
        /// The pool to promote.
        #[arg(long)]
        to: String,
        /// Promote it even if nothing proves it.
        #[arg(long)]
        force: bool,
        /// Do not ask first.
        #[arg(short, long)]
        yes: bool,
    },
    /// Give the primary role back to the policy's home pool.
    Failback {
        policy: String,
        #[arg(short, long)]
        yes: bool,
    },
    /// Stop the operator promoting on its own.
    Pause {
        policy: String,
        #[arg(short, long)]
        yes: bool,
    },
    /// Let the operator promote on its own again.
    Resume {
        policy: String,
        #[arg(short, long)]
        yes: bool,
    },
    /// Replay the primary's recorded traffic against the standby now (its `spec.loadProof`).
    ProveLoad {
        policy: String,
        #[arg(short, long)]
        yes: bool,
    },
}

async fn connect(args: &Args) -> anyhow::Result<(Client, String)> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &options).await?
        }
        None if args.context.is_some() => Config::from_kubeconfig(&options).await?,
        None => Config::infer().await?,
    };
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    Ok((Client::try_from(config)?, namespace))
}

/// Asks `question` on the terminal; yes only for `y` or `yes`.
fn confirmed(question: &str) -> anyhow::Result<bool> {
    let mut stderr = std::io::stderr();
    write!(stderr, "{question} [y/N] ")?;
    stderr.flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes"))
}

async fn change(api: &Api<FailoverPolicy>, name: &str, change: &Change, yes: bool) -> anyhow::Result<()> {
    let policy = api
        .get(name)
        .await
        .with_context(|| format!("reading FailoverPolicy {name}"))?;
    let token = format!("cli-{}", jiff::Timestamp::now().strftime("%Y%m%dT%H%M%SZ"));
    let planned = act::plan(&policy, change, &token)?;
    if !yes && !confirmed(&planned.question)? {
        bail!("nothing was changed");
    }
    let params = PatchParams {
        field_manager: Some("kubectl-understudy".to_owned()),
        ..PatchParams::default()
    };
    api.patch(name, &params, &Patch::Merge(&planned.patch))
        .await
        .with_context(|| format!("patching FailoverPolicy {name}"))?;
    println!("{}", planned.done);
    Ok(())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let (client, namespace) = connect(&args).await?;
    let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), &namespace);
    let out = args.output;
    let list = |all: bool| -> Api<FailoverPolicy> {
        if all {
            Api::all(client.clone())
        } else {
            policies.clone()
        }
    };
    let printed = match &args.command {
        Command::Get { all_namespaces } => {
            let items = list(*all_namespaces)
                .list(&ListParams::default())
                .await
                .context("listing FailoverPolicies")?
                .items;
            let data = json!({"apiVersion": "v1", "kind": "List", "items": items});
            out.render(&data, || view::policies(&items, *all_namespaces))?
        }
        Command::Describe { policy } => {
            let policy = policies
                .get(policy)
                .await
                .with_context(|| format!("reading FailoverPolicy {policy}"))?;
            out.render(&serde_json::to_value(&policy)?, || view::describe(&policy))?
        }
        Command::Coldstart { policy } => {
            let policy = policies
                .get(policy)
                .await
                .with_context(|| format!("reading FailoverPolicy {policy}"))?;
            let status = policy.status.clone().unwrap_or_default();
            let data = json!({"coldStart": status.cold_start, "coldStartSummary": status.cold_start_summary});
            out.render(&data, || view::cold_starts(&policy))?
        }
        Command::Gamedays { all_namespaces } => {
            let api: Api<GameDay> = if *all_namespaces {
                Api::all(client.clone())
            } else {
                Api::namespaced(client.clone(), &namespace)
            };
            let items = api
                .list(&ListParams::default())
                .await
                .context("listing GameDays")?
                .items;
            let data = json!({"apiVersion": "v1", "kind": "List", "items": items});
            out.render(&data, || view::gamedays(&items, *all_namespaces))?
        }
        Command::Switchover {
            policy,
            to,
            force,
            yes,
        } => {
            let asked = Change::Switchover {
                to: to.clone(),
                force: *force,
            };
            return change(&policies, policy, &asked, *yes).await;
        }
        Command::Failback { policy, yes } => return change(&policies, policy, &Change::Failback, *yes).await,
        Command::Pause { policy, yes } => return change(&policies, policy, &Change::Pause, *yes).await,
        Command::Resume { policy, yes } => return change(&policies, policy, &Change::Resume, *yes).await,
        Command::ProveLoad { policy, yes } => {
            return change(&policies, policy, &Change::ProveLoad, *yes).await;
        }
    };
    print!("{printed}");
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
