//! Standard five-field cron schedules, read in UTC, and the next time one fires.
//!
//! `minute hour day-of-month month day-of-week`, as Vixie cron reads them: `*`, lists (`1,15`),
//! ranges (`1-5`), steps (`*/15`, `0-30/10`, `5/20`), month and weekday names (`JAN`, `mon`),
//! Sunday as 0 or 7, and the macros `@yearly`, `@monthly`, `@weekly`, `@daily` and `@hourly`.
//! When both day fields are restricted, a day matching either one fires. A day field that starts
//! with `*` (`*`, `*/2`) counts as unrestricted, as in Vixie cron, so `0 0 */2 * MON` fires on odd
//! days that are Mondays; Kubernetes CronJobs (robfig/cron) count only `*` and `?` as
//! unrestricted and would fire that one on every odd day and every Monday.
//! In UTC, or in a time zone from the IANA database (bundled, so that it needs no files): a time a
//! daylight-saving change skips fires at the first instant after the gap, and a time it repeats
//! fires once, at its first occurrence. Pure; nothing here reads a clock.

use k8s_openapi::jiff::Timestamp;
use k8s_openapi::jiff::civil::{Date, DateTime};
use k8s_openapi::jiff::tz::TimeZone;

/// A cron expression that failed to parse, with the reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid cron schedule {expression:?}: {reason}")]
pub struct CronError {
    pub expression: String,
    pub reason: String,
}

/// A parsed five-field cron schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronSchedule {
    minutes: u64,
    hours: u64,
    days_of_month: u64,
    months: u64,
    days_of_week: u64,
    /// Both day fields restricted: a day matching either fires.
    either_day: bool,
}

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

/// How far ahead a schedule is searched: 28 years hold every weekday and leap-day combination.
const SEARCH_DAYS: i32 = 366 * 28;

impl CronSchedule {
    /// Parses a five-field expression or one of the `@` macros.
    pub fn parse(expression: &str) -> Result<Self, CronError> {
        let error = |reason: String| CronError {
            expression: expression.to_owned(),
            reason,
        };
        let text = match expression.trim() {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            other => other,
        };
        let fields: Vec<&str> = text.split_whitespace().collect();
        let [minute, hour, dom, month, dow] = fields[..] else {
            return Err(error(format!(
                "expected five fields (minute hour day-of-month month day-of-week), found {}",
                fields.len()
            )));
        };
        let days_of_week = field(dow, 0, 7, &WEEKDAYS).map_err(|r| error(format!("day-of-week: {r}")))?;
        // Sunday is 0 and 7.
        let days_of_week = (days_of_week | (days_of_week >> 7)) & 0x7f;
        Ok(CronSchedule {
            minutes: field(minute, 0, 59, &[]).map_err(|r| error(format!("minute: {r}")))?,
            hours: field(hour, 0, 23, &[]).map_err(|r| error(format!("hour: {r}")))?,
            days_of_month: field(dom, 1, 31, &[]).map_err(|r| error(format!("day-of-month: {r}")))?,
            months: field(month, 1, 12, &MONTHS).map_err(|r| error(format!("month: {r}")))?,
            days_of_week,
            either_day: !dom.starts_with('*') && !dow.starts_with('*'),
        })
    }

    /// The first time after `after`, to the minute, that the schedule fires; `None` when it never
    /// does (`0 0 31 2 *`) or not within 28 years.
    #[must_use]
    pub fn next_after(&self, after: Timestamp) -> Option<Timestamp> {
        self.next_after_in(after, &TimeZone::UTC)
    }

    /// The first time strictly after `after` at which the schedule fires, read in `zone`.
    #[must_use]
    pub fn next_after_in(&self, after: Timestamp, zone: &TimeZone) -> Option<Timestamp> {
        let now = zone.to_datetime(after);
        // The next whole minute strictly after `after`.
        let start = now
            .with()
            .second(0)
            .subsec_nanosecond(0)
            .build()
            .ok()?
            .checked_add(k8s_openapi::jiff::SignedDuration::from_mins(1))
            .ok()?;
        let mut date = start.date();
        for day in 0..SEARCH_DAYS {
            if day > 0 {
                date = date.tomorrow().ok()?;
            }
            if !self.fires_on(date) {
                continue;
            }
            let first_day = date == start.date();
            for hour in 0..24_i8 {
                if !bit(self.hours, hour) || (first_day && hour < start.hour()) {
                    continue;
                }
                for minute in 0..60_i8 {
                    if !bit(self.minutes, minute)
                        || (first_day && hour == start.hour() && minute < start.minute())
                    {
                        continue;
                    }
                    let at = DateTime::from_parts(date, k8s_openapi::jiff::civil::time(hour, minute, 0, 0));
                    let Ok(fires) = zone.to_ambiguous_timestamp(at).compatible() else {
                        continue;
                    };
                    // A gap moves a time forward past later ones; a repeated hour comes back.
                    if fires > after {
                        return Some(fires);
                    }
                }
            }
        }
        None
    }

    fn fires_on(&self, date: Date) -> bool {
        if !bit(self.months, date.month()) {
            return false;
        }
        let dom = bit(self.days_of_month, date.day());
        let dow = bit(self.days_of_week, date.weekday().to_sunday_zero_offset());
        if self.either_day { dom || dow } else { dom && dow }
    }
}

fn bit(mask: u64, value: i8) -> bool {
    u32::try_from(value).is_ok_and(|v| mask & (1 << v) != 0)
}

/// One field as a bit mask of the values it allows, within `min..=max`.
fn field(text: &str, min: u32, max: u32, names: &[&str]) -> Result<u64, String> {
    let mut mask = 0;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((range, step)) => {
                let step: u32 = step
                    .parse()
                    .map_err(|_| format!("step {step:?} is not a number"))?;
                if step == 0 {
                    return Err("a step must be at least 1".to_owned());
                }
                (range, step)
            }
            None => (part, 1),
        };
        let (low, high) = if range == "*" {
            (min, max)
        } else if let Some((low, high)) = range.split_once('-') {
            (value(low, min, max, names)?, value(high, min, max, names)?)
        } else {
            let single = value(range, min, max, names)?;
            // `5/20` runs from 5 to the end of the field.
            (single, if part.contains('/') { max } else { single })
        };
        if low > high {
            return Err(format!("range {range:?} runs backwards"));
        }
        mask |= (low..=high).step_by(step as usize).fold(0, |m, v| m | (1 << v));
    }
    Ok(mask)
}

fn value(text: &str, min: u32, max: u32, names: &[&str]) -> Result<u32, String> {
    let offset = if min == 1 { 1 } else { 0 };
    let parsed = match names.iter().position(|n| n.eq_ignore_ascii_case(text)) {
        Some(index) => u32::try_from(index).unwrap_or(u32::MAX) + offset,
        None => text.parse().map_err(|_| format!("{text:?} is not a number"))?,
    };
    if (min..=max).contains(&parsed) {
        Ok(parsed)
    } else {
        Err(format!("{parsed} is outside {min}-{max}"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().unwrap()
    }

    fn next(expression: &str, after: &str) -> String {
        CronSchedule::parse(expression)
            .unwrap()
            .next_after(at(after))
            .map_or_else(|| "never".to_owned(), |t| t.to_string())
    }

    fn next_in(expression: &str, zone: &str, after: &str) -> String {
        let zone = TimeZone::get(zone).unwrap();
        CronSchedule::parse(expression)
            .unwrap()
            .next_after_in(at(after), &zone)
            .map_or_else(|| "never".to_owned(), |t| t.to_string())
    }

    #[test]
    fn a_schedule_in_a_time_zone_fires_at_that_zones_wall_clock_time() {
        // 10:00 in Berlin is 08:00 UTC in summer and 09:00 UTC in winter.
        assert_eq!(
            next_in("0 10 * * TUE", "Europe/Berlin", "2024-06-01T12:00:00Z"),
            "2024-06-04T08:00:00Z"
        );
        assert_eq!(
            next_in("0 10 * * TUE", "Europe/Berlin", "2024-12-01T12:00:00Z"),
            "2024-12-03T09:00:00Z"
        );
        assert_eq!(
            next_in("0 10 * * TUE", "UTC", "2024-06-01T12:00:00Z"),
            next("0 10 * * TUE", "2024-06-01T12:00:00Z")
        );
    }

    #[test]
    fn a_time_daylight_saving_skips_fires_after_the_gap_and_a_repeated_one_fires_once() {
        // New York skipped 02:00-03:00 on 2026-03-08: 02:30 fires at 03:30 EDT (07:30 UTC).
        assert_eq!(
            next_in("30 2 * * *", "America/New_York", "2026-03-08T05:00:00Z"),
            "2026-03-08T07:30:00Z"
        );
        // It repeated 01:00-02:00 on 2026-11-01: 01:30 fires at the first one (05:30 UTC), and
        // the next is the day after, not the second 01:30 (06:30 UTC).
        assert_eq!(
            next_in("30 1 * * *", "America/New_York", "2026-11-01T04:00:00Z"),
            "2026-11-01T05:30:00Z"
        );
        assert_eq!(
            next_in("30 1 * * *", "America/New_York", "2026-11-01T05:30:00Z"),
            "2026-11-02T06:30:00Z"
        );
    }

    #[test]
    fn a_weekly_schedule_fires_on_the_next_matching_weekday() {
        // 2024-06-01 is a Saturday; Tuesdays at 10:00 UTC.
        assert_eq!(
            next("0 10 * * TUE", "2024-06-01T12:00:00Z"),
            "2024-06-04T10:00:00Z"
        );
        assert_eq!(next("0 10 * * 2", "2024-06-04T09:59:59Z"), "2024-06-04T10:00:00Z");
        // Exactly at a firing time, the next one is a week later.
        assert_eq!(next("0 10 * * 2", "2024-06-04T10:00:00Z"), "2024-06-11T10:00:00Z");
    }

    #[test]
    fn steps_ranges_and_lists_fire_where_cron_fires() {
        assert_eq!(
            next("*/15 * * * *", "2024-06-01T12:07:30Z"),
            "2024-06-01T12:15:00Z"
        );
        assert_eq!(
            next("5/20 * * * *", "2024-06-01T12:46:00Z"),
            "2024-06-01T13:05:00Z"
        );
        assert_eq!(
            next("0 9-17/4 * * *", "2024-06-01T13:30:00Z"),
            "2024-06-01T17:00:00Z"
        );
        assert_eq!(
            next("30 2 1,15 * *", "2024-06-02T00:00:00Z"),
            "2024-06-15T02:30:00Z"
        );
        assert_eq!(
            next("0 0 1 jan *", "2024-06-01T00:00:00Z"),
            "2025-01-01T00:00:00Z"
        );
        assert_eq!(next("@hourly", "2024-06-01T12:00:01Z"), "2024-06-01T13:00:00Z");
        assert_eq!(next("@weekly", "2024-06-01T12:00:00Z"), "2024-06-02T00:00:00Z");
    }

    #[test]
    fn sunday_is_both_zero_and_seven() {
        assert_eq!(next("0 0 * * 7", "2024-06-01T12:00:00Z"), "2024-06-02T00:00:00Z");
        assert_eq!(next("0 0 * * 0", "2024-06-01T12:00:00Z"), "2024-06-02T00:00:00Z");
    }

    #[test]
    fn two_restricted_day_fields_fire_on_either_day() {
        // The 13th, or any Friday: Friday 2024-06-07 comes first.
        assert_eq!(next("0 0 13 * 5", "2024-06-01T00:00:00Z"), "2024-06-07T00:00:00Z");
        // A `*` day-of-week leaves the day-of-month alone in charge.
        assert_eq!(next("0 0 13 * *", "2024-06-01T00:00:00Z"), "2024-06-13T00:00:00Z");
    }

    #[test]
    fn a_stepped_star_day_field_counts_as_unrestricted_as_in_vixie_cron() {
        // Odd days that are Mondays: not the 5th (odd, a Wednesday), not the 10th (a Monday).
        assert_eq!(
            next("0 0 */2 * MON", "2024-06-03T01:00:00Z"),
            "2024-06-17T00:00:00Z"
        );
    }

    #[test]
    fn leap_days_are_found_and_impossible_dates_never_fire() {
        assert_eq!(next("0 0 29 2 *", "2024-03-01T00:00:00Z"), "2028-02-29T00:00:00Z");
        assert_eq!(next("0 0 31 2 *", "2024-03-01T00:00:00Z"), "never");
    }

    #[test]
    fn nonsense_is_refused_with_the_field_named() {
        for (expression, reason) in [
            ("0 10 * *", "expected five fields"),
            ("60 * * * *", "minute: 60 is outside 0-59"),
            ("* 24 * * *", "hour: 24 is outside 0-23"),
            ("* * 0 * *", "day-of-month: 0 is outside 1-31"),
            ("* * * 13 *", "month: 13 is outside 1-12"),
            ("* * * * 8", "day-of-week: 8 is outside 0-7"),
            ("*/0 * * * *", "a step must be at least 1"),
            ("5-1 * * * *", "runs backwards"),
            ("* * * * FUNDAY", "is not a number"),
            ("@reboot", "expected five fields"),
        ] {
            let error = CronSchedule::parse(expression).unwrap_err();
            assert!(error.to_string().contains(reason), "{expression}: {error}");
        }
    }
}
