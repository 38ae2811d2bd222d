//! Times as status records them: RFC 3339 to the second, read back as a time since the Unix
//! epoch (the controllers' clock, and the local game day's).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

/// The time an RFC 3339 text names, since the Unix epoch; `None` when it names none, or one
/// before the epoch.
#[must_use]
pub fn since_epoch(rfc3339: &str) -> Option<Duration> {
    let at = rfc3339.parse::<Timestamp>().ok()?;
    Duration::try_from(Timestamp::UNIX_EPOCH.duration_until(at)).ok()
}

/// RFC 3339 to the second, from a time since the Unix epoch.
#[must_use]
pub fn rfc3339(since_unix_epoch: Duration) -> String {
    let seconds = i64::try_from(since_unix_epoch.as_secs()).unwrap_or(i64::MAX);
    Timestamp::from_second(seconds)
        .unwrap_or(Timestamp::MAX)
        .to_string()
}
