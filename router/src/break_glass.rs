//! `understudy-router grant`: a person granting an epoch by hand, when the operator cannot (its
//! cluster is gone, and the serving pool's fences are running out because the other pool can no
//! longer vouch for them). It pushes one round of grants ([`grant_round`]) to the fences named on
//! the command line with the fences' control token, and prints what each answered.
//!
//! The person is the fence here: a grant at an epoch above every fence's makes its holder serve,
//! and nothing checks that the other pool has really stopped. `--old-holder-gone` says it has (its
//! fences are gone or cut off from every client); without it, the holder's fences wait out the
//! other pool's grants when any of them cannot be told. When the operator's cluster is back, its
//! epoch Lease must be moved to the same epoch and holder before it grants again: the fences
//! refuse a grant below the epoch they hold (`GrantRefused`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use understudy_api::grant::{
    FenceAddr, GRANT_PATH, Grant, GrantAnswer, GrantTiming, PoolFences, grant_round,
};
use understudy_core::Epoch;

/// `understudy-router grant`'s arguments.
#[derive(clap::Args, Debug)]
pub struct GrantArgs {
    /// The epoch to grant: above the highest any fence holds, or they refuse it.
    #[arg(long)]
    pub epoch: u64,
    /// The pool that serves at that epoch.
    #[arg(long)]
    pub holder: String,
    /// A pool and its fences, `NAME=HOST:PORT[,HOST:PORT...]`; once per pool.
    #[arg(long = "pool", value_parser = pool_arg, required = true)]
    pub pools: Vec<(String, Vec<SocketAddr>)>,
    /// How long the grant lets the holder serve, e.g. `1h`: run the command again before then,
    /// or hand back to the operator.
    #[arg(long, default_value = "1h", value_parser = duration_arg)]
    pub ttl: Duration,
    /// The other pools' fences are gone or cut off from every client: the holder serves at once,
    /// without waiting out the grants of the ones that cannot be told.
    #[arg(long)]
    pub old_holder_gone: bool,
    /// The policy, `namespace/name`, for the fences' logs.
    #[arg(long, default_value = "")]
    pub policy: String,
    /// File holding the fences' control token; without it, `UNDERSTUDY_CONTROL_TOKEN`.
    #[arg(long, env = "UNDERSTUDY_CONTROL_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

fn pool_arg(text: &str) -> Result<(String, Vec<SocketAddr>), String> {
    let (name, fences) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: not NAME=HOST:PORT[,HOST:PORT...]"))?;
    if name.is_empty() {
        return Err(format!("{text:?}: the pool has no name"));
    }
    let fences = fences
        .split(',')
        .map(|f| f.trim().parse().map_err(|e| format!("{f:?}: {e}")))
        .collect::<Result<Vec<SocketAddr>, String>>()?;
    Ok((name.to_owned(), fences))
}

fn duration_arg(text: &str) -> Result<Duration, String> {
    match understudy_core::duration::parse(text) {
        Ok(d) if d >= Duration::from_secs(3) => Ok(d),
        Ok(_) => Err("must be at least 3s".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// Grants once; fails when a fence of the holder did not take the grant.
pub async fn grant(args: GrantArgs, token: &str) -> anyhow::Result<()> {
    if !args.pools.iter().any(|(name, _)| *name == args.holder) {
        anyhow::bail!("--holder {} names none of the --pool given", args.holder);
    }
    let timing = GrantTiming {
        ttl: args.ttl,
        renew_every: args.ttl / 3,
        skew: Duration::ZERO,
        push_timeout: Duration::from_secs(5),
    };
    let pools: Vec<PoolFences> = args
        .pools
        .iter()
        .map(|(name, fences)| PoolFences {
            pool: name.clone(),
            fences: fences
                .iter()
                .map(|f| FenceAddr {
                    grantor: f.to_string(),
                    peer: f.to_string(),
                })
                .collect(),
            // The person names every fence there is.
            complete: true,
        })
        .collect();
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let bearer = format!("Bearer {token}");
    let old_gone = args.old_holder_gone;
    let push = |fence: String, mut grant: Grant| {
        let (client, bearer) = (client.clone(), bearer.clone());
        async move {
            // Only the holder's fences read it: they serve at once.
            grant.prior_revoked |= old_gone;
            push(&client, &fence, &bearer, &grant, timing.push_timeout).await
        }
    };
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("the clock is before 1970")?;
    let round = grant_round(
        &timing,
        &args.policy,
        (Epoch(args.epoch), &args.holder),
        &pools,
        wall,
        push,
    )
    .await;
    let mut missed = 0;
    for answer in &round.answers {
        let said = match &answer.answer {
            GrantAnswer::Took(view) => format!("took it: {:?}", view.standing),
            GrantAnswer::Stale(view) => format!("refused it: it holds epoch {:?}", view.epoch.map(|e| e.0)),
            GrantAnswer::TakesNoGrants => "takes no grants".to_owned(),
            GrantAnswer::Failed(why) => why.clone(),
        };
        if answer.pool == args.holder && !matches!(answer.answer, GrantAnswer::Took(_)) {
            missed += 1;
        }
        println!("{} {}: {said}", answer.pool, answer.fence);
    }
    if missed > 0 {
        anyhow::bail!(
            "{missed} fence(s) of {} did not take epoch {}",
            args.holder,
            args.epoch
        );
    }
    Ok(())
}

async fn push(
    client: &Client<HttpConnector, Full<Bytes>>,
    fence: &str,
    bearer: &str,
    grant: &Grant,
    within: Duration,
) -> GrantAnswer {
    let body = Bytes::from(serde_json::to_vec(grant).unwrap_or_default());
    let request = http::Request::put(format!("http://{fence}{GRANT_PATH}"))
        .header(http::header::AUTHORIZATION, bearer)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body));
    let Ok(request) = request else {
        return GrantAnswer::Failed(format!("{fence}: not an address"));
    };
    let answer = tokio::time::timeout(within, async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, body))
    })
    .await;
    match answer {
        Ok(Ok((status, body))) => GrantAnswer::read(status, &body),
        Ok(Err(why)) => GrantAnswer::Failed(format!("{fence}: {why}")),
        Err(_) => GrantAnswer::Failed(format!("{fence}: no answer within {within:?}")),
    }
}
