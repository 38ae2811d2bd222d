//! Admission control after a new route: for a window after the switch, work is admitted to the
//! new primary under a budget that starts low and ramps up with time, and is cut back when the
//! first-token latency climbs above the lowest seen (Envoy's gradient controller, on TTFT rather
//! than end-to-end latency, which output length confounds). The budget counts concurrent requests
//! and prompt tokens; priority classes get shares of it, so batch is shed first and interactive
//! last. A request that is certain to miss its deadline is never admitted.
//!
//! Tenants (told apart by their API key, or a header the operator names) share the budget
//! fairly: while more than one has asked lately, none may hold more than its even part of its
//! class's share, so one tenant's burst after a promotion cannot take the whole budget and starve
//! the others. A tenant shed for that is remembered for a while, so that the tenant holding the
//! budget gives way as its requests finish.
//!
//! The budget and the decision are pure functions of settings, elapsed time and observations;
//! [`Admission`] only keeps the counters. This module must never queue or sleep: a request it
//! refuses is shed (429) at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;
use understudy_api::route::AdmissionSettings;

/// The header that carries a request's priority when its route names none (a route carries the
/// policy's `spec.admission.priorityHeader`).
pub const PRIORITY_HEADER: &str = understudy_api::route::DEFAULT_PRIORITY_HEADER;
/// The header that carries how many milliseconds the client will wait for a first token.
pub const DEADLINE_HEADER: &str = "x-understudy-deadline-ms";

/// A request's priority class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// A person is waiting: keeps its latency, shed last.
    Interactive = 0,
    /// No header, or an unknown value.
    Default = 1,
    /// Offline work: waits or is shed first.
    Batch = 2,
}

impl Priority {
    /// All classes, in metrics order.
    pub const ALL: [Priority; 3] = [Priority::Interactive, Priority::Default, Priority::Batch];

    /// Reads the header value; anything unknown is [`Priority::Default`].
    #[must_use]
    pub fn from_header(value: Option<&[u8]>) -> Priority {
        match value {
            Some(b"interactive") => Priority::Interactive,
            Some(b"batch") => Priority::Batch,
            _ => Priority::Default,
        }
    }

    /// The share of the budget this class may fill.
    #[must_use]
    pub fn share(self) -> f64 {
        match self {
            Priority::Interactive => 1.0,
            Priority::Default => 0.75,
            Priority::Batch => 0.4,
        }
    }

    /// The label value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Default => "default",
            Priority::Batch => "batch",
        }
    }
}

/// What may be in flight at one moment of the window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    /// Concurrent requests.
    pub concurrency: f64,
    /// Prompt tokens of the requests in flight.
    pub prefill_tokens: f64,
}

/// First-token latency seen on the route so far (microseconds, 0 for none yet).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftSeen {
    /// The lowest sample.
    pub min_us: u64,
    /// The moving average.
    pub avg_us: u64,
}

/// The budget `elapsed` into the window, or `None` once the window is over. Pure.
#[must_use]
pub fn budget(settings: &AdmissionSettings, elapsed: Duration, ttft: TtftSeen) -> Option<Budget> {
    let window = settings.window();
    if elapsed >= window {
        return None;
    }
    let ramp = elapsed.as_secs_f64() / window.as_secs_f64();
    // The gradient: 1 while the average is within the buffer of the best seen, down to 0.5 as
    // queueing builds up on the new primary.
    let gradient = if ttft.min_us > 0 && ttft.avg_us > 0 {
        (ttft.min_us as f64 * (1.0 + settings.ttft_buffer) / ttft.avg_us as f64).clamp(0.5, 1.0)
    } else {
        1.0
    };
    let lerp = |lo: f64, hi: f64| (lo + (hi - lo) * ramp) * gradient;
    Some(Budget {
        concurrency: lerp(
            f64::from(settings.initial_concurrency),
            f64::from(settings.max_concurrency),
        )
        .max(f64::from(settings.initial_concurrency)),
        prefill_tokens: lerp(
            settings.initial_prefill_tokens as f64,
            settings.max_prefill_tokens as f64,
        )
        .max(settings.initial_prefill_tokens as f64),
    })
}

/// Why a request was shed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shed {
    /// Its class's share of concurrent requests is full.
    Concurrency,
    /// Its class's share of prompt tokens is full.
    PrefillTokens,
    /// Its deadline is shorter than the fastest first token seen: it would certainly miss it.
    Deadline,
    /// Its tenant already holds its even part of the budget while other tenants are asking.
    TenantShare,
    /// Its priority is one the policy sheds outright while the window is open
    /// (`spec.admission.shedPriorities`).
    Priority,
    /// Nothing could take it now and the waiting room holds its class's share already: shed
    /// rather than queued.
    WaitingRoom,
}

impl Shed {
    /// Every reason, in metrics order (each one's discriminant is its index).
    pub const ALL: [Shed; 6] = [
        Shed::Concurrency,
        Shed::PrefillTokens,
        Shed::Deadline,
        Shed::TenantShare,
        Shed::Priority,
        Shed::WaitingRoom,
    ];
}

impl Shed {
    /// The label value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::Concurrency => "concurrency",
            Shed::PrefillTokens => "prefill_tokens",
            Shed::Deadline => "deadline",
            Shed::TenantShare => "tenant_share",
            Shed::Priority => "priority",
            Shed::WaitingRoom => "waiting_room",
        }
    }
}

/// A tenant, as a hash of what names it (never the API key itself); 0 for requests that name none.
pub type Tenant = u64;

/// How long a tenant that asked counts as asking, in- or outside the budget: longer than the
/// longest `Retry-After` a shed request is given, so a tenant that comes back still counts.
pub const TENANT_MEMORY: Duration = Duration::from_secs(6);

/// What a request asks of the budget.
#[derive(Clone, Copy, Debug)]
pub struct Ask {
    /// Its class.
    pub priority: Priority,
    /// Its prompt tokens, estimated.
    pub prompt_tokens: u64,
    /// How long the client will wait for a first token, if it said.
    pub deadline: Option<Duration>,
    /// Its tenant.
    pub tenant: Tenant,
    /// Its priority value is one its route sheds while the window is open.
    pub shed_listed: bool,
}

/// One tenant's place in the budget when it asks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantLoad {
    /// Its requests in flight.
    pub in_flight: u32,
    /// Their prompt tokens.
    pub tokens: u64,
    /// Tenants asking lately, itself included.
    pub asking: u32,
}

/// Whether a tenant may have one more request in flight, within its even part of the class's
/// share of `budget`. Pure. A tenant with nothing in flight may always have one.
pub fn fair(budget: Budget, ask: &Ask, load: TenantLoad) -> Result<(), Shed> {
    if load.asking <= 1 || load.in_flight == 0 {
        return Ok(());
    }
    let part = ask.priority.share() / f64::from(load.asking);
    if f64::from(load.in_flight + 1) > (budget.concurrency * part).max(1.0)
        || (load.tokens + ask.prompt_tokens) as f64 > budget.prefill_tokens * part
    {
        return Err(Shed::TenantShare);
    }
    Ok(())
}

/// Admit or shed one request, given what is in flight. Pure.
pub fn decide(
    budget: Option<Budget>,
    in_flight: u32,
    tokens_in_flight: u64,
    ask: Ask,
    fastest_ttft: Duration,
) -> Result<(), Shed> {
    if ask.shed_listed && budget.is_some() {
        return Err(Shed::Priority);
    }
    if let Some(deadline) = ask.deadline
        && deadline < fastest_ttft
    {
        return Err(Shed::Deadline);
    }
    let Some(b) = budget else { return Ok(()) };
    let share = ask.priority.share();
    // Every class may always have one request in flight, so nothing starves outright.
    if in_flight > 0 && f64::from(in_flight + 1) > (b.concurrency * share).max(1.0) {
        return Err(Shed::Concurrency);
    }
    if in_flight > 0 && (tokens_in_flight + ask.prompt_tokens) as f64 > b.prefill_tokens * share {
        return Err(Shed::PrefillTokens);
    }
    Ok(())
}

/// Prompt tokens estimated from a request body's size (about four bytes a token, JSON included).
#[must_use]
pub fn estimate_prompt_tokens(body_len: usize) -> u64 {
    (body_len as u64).div_ceil(4)
}

/// The counters of one route's admission.
#[derive(Debug)]
pub struct Admission {
    settings: AdmissionSettings,
    start: Instant,
    in_flight: AtomicU32,
    tokens: AtomicU64,
    min_ttft_us: AtomicU64,
    avg_ttft_us: AtomicU64,
    /// Each tenant's requests in flight, their tokens, and when it last asked; touched only
    /// while the window is open.
    tenants: Mutex<HashMap<Tenant, TenantEntry>>,
}

#[derive(Clone, Copy, Debug)]
struct TenantEntry {
    in_flight: u32,
    tokens: u64,
    asked: Instant,
}

impl Admission {
    /// Admission for a route that arrived `start`.
    #[must_use]
    pub fn new(settings: AdmissionSettings, start: Instant) -> Self {
        Admission {
            settings,
            start,
            in_flight: AtomicU32::new(0),
            tokens: AtomicU64::new(0),
            min_ttft_us: AtomicU64::new(0),
            avg_ttft_us: AtomicU64::new(0),
            tenants: Mutex::new(HashMap::new()),
        }
    }

    fn tenants(&self) -> std::sync::MutexGuard<'_, HashMap<Tenant, TenantEntry>> {
        // Counters only: a poisoned map is still the best count there is.
        self.tenants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The first-token latencies seen.
    #[must_use]
    pub fn ttft(&self) -> TtftSeen {
        TtftSeen {
            min_us: self.min_ttft_us.load(Relaxed),
            avg_us: self.avg_ttft_us.load(Relaxed),
        }
    }

    /// The budget now, `None` once the window is over.
    #[must_use]
    pub fn budget(&self, now: Instant) -> Option<Budget> {
        budget(
            &self.settings,
            now.saturating_duration_since(self.start),
            self.ttft(),
        )
    }

    /// When the window began: when the route's epoch arrived.
    #[must_use]
    pub fn start(&self) -> Instant {
        self.start
    }

    /// True while the window is open.
    #[must_use]
    pub fn in_window(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.start) < self.settings.window()
    }

    /// Admits the request (the permit holds its place until dropped) or sheds it.
    pub fn try_admit(self: &Arc<Self>, ask: Ask, now: Instant) -> Result<Permit, Shed> {
        let budget = self.budget(now);
        // While the window is open, the tenant's part first; its entry is held to the end so
        // that two of its requests cannot both take the last place.
        let mut tenants = budget.map(|_| self.tenants());
        if let (Some(b), Some(tenants)) = (budget, tenants.as_mut()) {
            let entry = tenants.entry(ask.tenant).or_insert(TenantEntry {
                in_flight: 0,
                tokens: 0,
                asked: now,
            });
            entry.asked = now;
            let load = TenantLoad {
                in_flight: entry.in_flight,
                tokens: entry.tokens,
                asking: 0,
            };
            tenants.retain(|_, e| e.in_flight > 0 || now.saturating_duration_since(e.asked) < TENANT_MEMORY);
            let asking = u32::try_from(tenants.len()).unwrap_or(u32::MAX);
            fair(b, &ask, TenantLoad { asking, ..load })?;
        }
        let fastest = Duration::from_micros(self.min_ttft_us.load(Relaxed));
        let tokens = self.tokens.load(Relaxed);
        let mut shed = None;
        let admitted = self.in_flight.fetch_update(Relaxed, Relaxed, |n| {
            match decide(budget, n, tokens, ask, fastest) {
                Ok(()) => Some(n + 1),
                Err(s) => {
                    shed = Some(s);
                    None
                }
            }
        });
        match admitted {
            Ok(_) => {
                self.tokens.fetch_add(ask.prompt_tokens, Relaxed);
                let tenant = tenants
                    .as_mut()
                    .and_then(|t| t.get_mut(&ask.tenant))
                    .map(|entry| {
                        entry.in_flight += 1;
                        entry.tokens += ask.prompt_tokens;
                        ask.tenant
                    });
                Ok(Permit {
                    admission: Arc::clone(self),
                    tokens: ask.prompt_tokens,
                    tenant,
                })
            }
            Err(_) => Err(shed.unwrap_or(Shed::Concurrency)),
        }
    }

    /// Folds in one first-token latency.
    pub fn record_ttft(&self, ttft: Duration) {
        let us = u64::try_from(ttft.as_micros()).unwrap_or(u64::MAX).max(1);
        let _ = self
            .min_ttft_us
            .fetch_update(Relaxed, Relaxed, |m| (m == 0 || us < m).then_some(us));
        let old = self.avg_ttft_us.load(Relaxed);
        let new = if old == 0 { us } else { old - old / 8 + us / 8 };
        self.avg_ttft_us.store(new, Relaxed);
    }

    /// Seconds a shed client should wait before trying again.
    #[must_use]
    pub fn retry_after_s(&self, now: Instant) -> u64 {
        let left = self
            .settings
            .window()
            .saturating_sub(now.saturating_duration_since(self.start));
        left.as_secs().clamp(1, 5)
    }
}

/// A place in the budget, given back on drop.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    tokens: u64,
    /// The tenant it counts for, when admitted inside the window.
    tenant: Option<Tenant>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.admission.in_flight.fetch_sub(1, Relaxed);
        self.admission.tokens.fetch_sub(self.tokens, Relaxed);
        if let Some(tenant) = self.tenant
            && let Some(entry) = self.admission.tenants().get_mut(&tenant)
        {
            entry.in_flight = entry.in_flight.saturating_sub(1);
            entry.tokens = entry.tokens.saturating_sub(self.tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn settings() -> AdmissionSettings {
        AdmissionSettings {
            window_s: 60.0,
            initial_concurrency: 10,
            max_concurrency: 100,
            initial_prefill_tokens: 10_000,
            max_prefill_tokens: 100_000,
            ttft_buffer: 0.25,
            ..AdmissionSettings::default()
        }
    }

    fn ask(priority: Priority) -> Ask {
        Ask {
            priority,
            prompt_tokens: 10,
            deadline: None,
            tenant: 0,
            shed_listed: false,
        }
    }

    fn of(tenant: Tenant) -> Ask {
        Ask {
            tenant,
            ..ask(Priority::Interactive)
        }
    }

    #[test]
    fn the_budget_starts_low_ramps_with_time_and_ends_with_the_window() {
        let s = settings();
        let at = |secs| budget(&s, Duration::from_secs(secs), TtftSeen::default());
        assert_eq!(at(0).unwrap().concurrency, 10.0);
        assert_eq!(at(30).unwrap().concurrency, 55.0);
        assert!(at(59).unwrap().concurrency > 95.0);
        assert_eq!(at(60), None);
    }

    #[test]
    fn a_slower_first_token_than_the_best_seen_cuts_the_budget_by_at_most_half() {
        let s = settings();
        let calm = TtftSeen {
            min_us: 100_000,
            avg_us: 110_000,
        };
        let storm = TtftSeen {
            min_us: 100_000,
            avg_us: 1_000_000,
        };
        let at = |t| budget(&s, Duration::from_secs(30), t).unwrap().concurrency;
        assert_eq!(at(calm), 55.0);
        assert_eq!(at(storm), 27.5);
        assert_eq!(
            budget(&s, Duration::ZERO, storm).unwrap().concurrency,
            10.0,
            "never below the start"
        );
    }

    #[test]
    fn batch_is_shed_first_then_default_and_interactive_last() {
        let b = budget(&settings(), Duration::ZERO, TtftSeen::default());
        let at = |n, p| decide(b, n, 0, ask(p), Duration::ZERO);
        // Budget 10: batch fills 4, default 7.5, interactive 10.
        assert_eq!(at(3, Priority::Batch), Ok(()));
        assert_eq!(at(4, Priority::Batch), Err(Shed::Concurrency));
        assert_eq!(at(6, Priority::Default), Ok(()));
        assert_eq!(at(7, Priority::Default), Err(Shed::Concurrency));
        assert_eq!(at(9, Priority::Interactive), Ok(()));
        assert_eq!(at(10, Priority::Interactive), Err(Shed::Concurrency));
        assert_eq!(
            decide(None, 10_000, 0, ask(Priority::Batch), Duration::ZERO),
            Ok(())
        );
    }

    #[test]
    fn a_priority_the_policy_sheds_is_refused_in_the_window_and_only_then() {
        let s = settings();
        let b = budget(&s, Duration::ZERO, TtftSeen::default());
        let listed = Ask {
            shed_listed: true,
            ..ask(Priority::Default)
        };
        assert_eq!(decide(b, 0, 0, listed, Duration::ZERO), Err(Shed::Priority));
        assert_eq!(decide(None, 0, 0, listed, Duration::ZERO), Ok(()));
        assert_eq!(decide(b, 0, 0, ask(Priority::Default), Duration::ZERO), Ok(()));
    }

    #[test]
    fn prompt_tokens_are_budgeted_but_a_lone_request_always_goes() {
        let b = budget(&settings(), Duration::ZERO, TtftSeen::default());
        let big = Ask {
            prompt_tokens: 50_000,
            ..ask(Priority::Interactive)
        };
        assert_eq!(decide(b, 1, 0, big, Duration::ZERO), Err(Shed::PrefillTokens));
        assert_eq!(decide(b, 0, 0, big, Duration::ZERO), Ok(()));
    }

    #[test]
    fn a_deadline_shorter_than_the_fastest_first_token_is_shed_even_after_the_window() {
        let tight = Ask {
            deadline: Some(Duration::from_millis(50)),
            ..ask(Priority::Interactive)
        };
        assert_eq!(
            decide(None, 0, 0, tight, Duration::from_millis(80)),
            Err(Shed::Deadline)
        );
        assert_eq!(decide(None, 0, 0, tight, Duration::from_millis(20)), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn permits_hold_places_until_dropped_and_full_admission_returns_after_the_window() {
        let a = Arc::new(Admission::new(settings(), Instant::now()));
        let held: Vec<_> = (0..4)
            .map(|_| a.try_admit(ask(Priority::Batch), Instant::now()).unwrap())
            .collect();
        assert_eq!(
            a.try_admit(ask(Priority::Batch), Instant::now()).unwrap_err(),
            Shed::Concurrency
        );
        drop(held);
        let again: Vec<_> = (0..4)
            .map(|_| a.try_admit(ask(Priority::Batch), Instant::now()).unwrap())
            .collect();
        tokio::time::advance(Duration::from_secs(60)).await;
        let more: Vec<_> = (0..500)
            .map(|_| a.try_admit(ask(Priority::Batch), Instant::now()).unwrap())
            .collect();
        assert!(!a.in_window(Instant::now()));
        assert_eq!(again.len() + more.len(), 504);
    }

    #[test]
    fn a_tenant_may_hold_its_even_part_of_its_class_share_while_others_ask() {
        let b = budget(&settings(), Duration::ZERO, TtftSeen::default()).unwrap();
        let load = |in_flight, asking| TenantLoad {
            in_flight,
            tokens: 0,
            asking,
        };
        // Alone, the whole share (the global check decides); with one other asking, half of
        // the 10 places; with four, 2.5 of them; nothing in flight, always one.
        assert_eq!(fair(b, &of(1), load(9, 1)), Ok(()));
        assert_eq!(fair(b, &of(1), load(4, 2)), Ok(()));
        assert_eq!(fair(b, &of(1), load(5, 2)), Err(Shed::TenantShare));
        assert_eq!(fair(b, &of(1), load(2, 4)), Err(Shed::TenantShare));
        assert_eq!(fair(b, &of(1), load(0, 1000)), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_holding_the_budget_gives_way_to_one_that_asks_as_its_requests_finish() {
        let a = Arc::new(Admission::new(settings(), Instant::now()));
        let now = Instant::now;
        // The noisy tenant takes all ten places before the quiet one shows up.
        let mut noisy: Vec<_> = (0..10).map(|_| a.try_admit(of(1), now()).unwrap()).collect();
        assert_eq!(a.try_admit(of(2), now()).unwrap_err(), Shed::Concurrency);
        // The quiet one asked, so now the noisy one is held to half: as its requests finish,
        // the places go to the quiet one, not back to it.
        noisy.truncate(5);
        assert_eq!(a.try_admit(of(1), now()).unwrap_err(), Shed::TenantShare);
        let quiet: Vec<_> = (0..5).map(|_| a.try_admit(of(2), now()).unwrap()).collect();
        assert_eq!(a.try_admit(of(2), now()).unwrap_err(), Shed::TenantShare);
        assert_eq!(a.try_admit(of(1), now()).unwrap_err(), Shed::TenantShare);
        drop(quiet);
        // A tenant that stopped asking stops counting once its memory runs out.
        assert_eq!(a.try_admit(of(1), now()).unwrap_err(), Shed::TenantShare);
        tokio::time::advance(TENANT_MEMORY).await;
        let more: Vec<_> = (0..5).map(|_| a.try_admit(of(1), now()).unwrap()).collect();
        assert_eq!(noisy.len() + more.len(), 10);
    }

    #[test]
    fn the_priority_header_reads_three_classes_and_defaults_the_rest() {
        assert_eq!(Priority::from_header(Some(b"batch")), Priority::Batch);
        assert_eq!(Priority::from_header(Some(b"interactive")), Priority::Interactive);
        assert_eq!(Priority::from_header(Some(b"urgent!!")), Priority::Default);
        assert_eq!(Priority::from_header(None), Priority::Default);
    }
}
