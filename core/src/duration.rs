//! Durations written the way Kubernetes and Go write them: `10s`, `1m30s`, `850ms`, `1h2m3.5s`.
//!
//! Policies take durations in this form (so a CRD's CEL rules can compare them with
//! `duration()`), and the kubelet prints image-pull times in it. Parsing follows Go's
//! `time.ParseDuration`, except that negative durations are refused: nothing in understudy
//! waits a negative time.

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseDurationError {
    #[error("empty duration")]
    Empty,
    #[error("negative duration {0:?}: durations must be zero or more")]
    Negative(String),
    #[error("invalid duration {0:?}: expected numbers with units h, m, s, ms, us or ns, like 1m30s")]
    Invalid(String),
    #[error("duration {0:?} is too large: the longest is 2562047h47m16.854775807s, as in Go")]
    Overflow(String),
}

/// Parses a Go-style duration such as `1m30s`, `1.5h` or `850ms`. A bare `0` is zero.
pub fn parse(text: &str) -> Result<Duration, ParseDurationError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(ParseDurationError::Empty);
    }
    if s.starts_with('-') {
        return Err(ParseDurationError::Negative(text.to_owned()));
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let invalid = || ParseDurationError::Invalid(text.to_owned());
    let overflow = || ParseDurationError::Overflow(text.to_owned());
    let mut rest = s;
    let mut total_nanos: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(invalid)?;
        let (number, tail) = rest.split_at(number_len);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(invalid());
        }
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            _ => return Err(invalid()),
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| overflow())?
        };
        let mut nanos = whole.checked_mul(unit_nanos).ok_or_else(overflow)?;
        // Fractions are exact up to nanoseconds; digits beyond that are dropped, as Go does.
        let mut scale = unit_nanos;
        for digit in fraction.bytes() {
            scale /= 10;
            if scale == 0 {
                break;
            }
            nanos += u128::from(digit - b'0') * scale;
        }
        total_nanos = total_nanos.checked_add(nanos).ok_or_else(overflow)?;
        rest = tail;
    }
    // Go keeps a duration in an i64 of nanoseconds and refuses longer ones; so does the API
    // server's `duration()` in CEL, and so must anything that adds one to a clock.
    if total_nanos > i64::MAX as u128 {
        return Err(overflow());
    }
    let secs = (total_nanos / 1_000_000_000) as u64;
    Ok(Duration::new(secs, (total_nanos % 1_000_000_000) as u32))
}

/// Formats a duration the way Go prints one: `1h2m3s`, `1m30s`, `850ms`, `1.5s`, `0s`.
pub fn format(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    if nanos < 1_000_000_000 {
        let (value, unit) = if nanos < 1_000 {
            (nanos as f64, "ns")
        } else if nanos < 1_000_000 {
            (nanos as f64 / 1e3, "µs")
        } else {
            (nanos as f64 / 1e6, "ms")
        };
        return format!("{}{unit}", trim_float(value));
    }
    let hours = nanos / 3_600_000_000_000;
    let minutes = (nanos / 60_000_000_000) % 60;
    let seconds = (nanos % 60_000_000_000) as f64 / 1e9;
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&format!("{hours}h"));
    }
    if hours > 0 || minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    out.push_str(&format!("{}s", trim_float(seconds)));
    out
}

fn trim_float(value: f64) -> String {
    let text = format!("{value:.9}");
    let text = text.trim_end_matches('0');
    text.trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_kubelet_and_policies_use() {
        assert_eq!(parse("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("850ms"), Ok(Duration::from_millis(850)));
        assert_eq!(parse("1h2m3s"), Ok(Duration::from_secs(3723)));
        assert_eq!(parse("46.9444707s"), Ok(Duration::from_nanos(46_944_470_700)));
        assert_eq!(parse("1m2.5s"), Ok(Duration::from_millis(62_500)));
        assert_eq!(parse("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("250µs"), Ok(Duration::from_micros(250)));
        assert_eq!(parse("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert_eq!(parse(".5s"), Ok(Duration::from_millis(500)));
    }

    #[test]
    fn refuses_negative_unitless_and_garbled_durations() {
        assert!(matches!(parse("-5s"), Err(ParseDurationError::Negative(_))));
        assert!(matches!(parse(""), Err(ParseDurationError::Empty)));
        for bad in ["10", "s", "1x", "1..5s", "1m30", "ten seconds", "1 s"] {
            assert!(
                matches!(parse(bad), Err(ParseDurationError::Invalid(_))),
                "{bad} should be invalid"
            );
        }
        assert!(matches!(
            parse("99999999999999999999999h"),
            Err(ParseDurationError::Overflow(_))
        ));
    }

    #[test]
    fn the_longest_duration_is_gos() {
        let longest = Duration::new(9_223_372_036, 854_775_807);
        assert_eq!(parse("2562047h47m16.854775807s"), Ok(longest));
        assert_eq!(parse("9223372036854775807ns"), Ok(longest));
        for too_long in ["2562047h47m16.854775808s", "2562048h", "2562047788015215h"] {
            assert!(
                matches!(parse(too_long), Err(ParseDurationError::Overflow(_))),
                "{too_long} should be too large"
            );
        }
    }

    #[test]
    fn formats_like_go_and_round_trips() {
        for (text, expected) in [
            ("90s", "1m30s"),
            ("850ms", "850ms"),
            ("3723s", "1h2m3s"),
            ("1.5s", "1.5s"),
        ] {
            let parsed = parse(text).unwrap_or_default();
            assert_eq!(format(parsed), expected);
            assert_eq!(parse(expected), Ok(parsed));
        }
        assert_eq!(format(Duration::ZERO), "0s");
    }
}
