//! `timeline.svg`: a run on one time axis. Requests by outcome (by when they were sent, stacked
//! per quarter second), the p99 time to first token per second, the fault, the predicted window
//! for its detection beside the measured one, and the promotion's steps as bands.
//!
//! Plain SVG 1.1 with no script or external reference, so any browser opens it as it is.

use std::fmt::Write as _;
use std::time::Duration;

use super::load::{RequestOutcome, RequestRecord};
use super::report::RunReport;

const WIDTH: f64 = 960.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 20.0;
const BUCKET: Duration = Duration::from_millis(250);

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG of `run`, drawn from `records`.
#[must_use]
pub fn svg(run: &RunReport, records: &[RequestRecord]) -> String {
    let axis = TimeAxis {
        end_ms: run.duration_ms.max(1.0),
    };
    let seconds = (axis.end_ms / 1000.0).ceil() as usize;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="446" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{WIDTH}" height="446" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="18" font-size="14">{} ({:?})</text>"#,
        escape(&run.name),
        run.verdict
    );
    draw_requests(&mut out, axis, records);
    draw_ttft(&mut out, axis, records, seconds);
    // The fault, detection (predicted and measured) and the promotion's steps: y from 350.
    let band = 350.0;
    draw_faults(&mut out, axis, run);
    draw_detection(&mut out, axis, run, band);
    draw_promotion(&mut out, axis, run, band);
    // The time axis.
    for s in (0..=seconds).step_by(5) {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="442" text-anchor="middle">{s} s</text>"#,
            axis.x(s as f64 * 1000.0)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The run's time on the drawing's x axis, from its start to its end.
#[derive(Clone, Copy)]
struct TimeAxis {
    end_ms: f64,
}

impl TimeAxis {
    /// Where `ms` into the run falls; times outside the run are drawn at its edges.
    fn x(self, ms: f64) -> f64 {
        LEFT + (WIDTH - LEFT - RIGHT) * (ms / self.end_ms).clamp(0.0, 1.0)
    }
}

/// Requests by outcome: y from 40 to 200.
fn draw_requests(out: &mut String, axis: TimeAxis, records: &[RequestRecord]) {
    let buckets = (axis.end_ms / BUCKET.as_millis() as f64).ceil() as usize + 1;
    let counts = outcome_counts(records, buckets);
    let most = counts
        .iter()
        .map(|c| c.iter().sum::<u32>())
        .max()
        .unwrap_or(1)
        .max(1);
    let (top, height) = (40.0, 160.0);
    let bar = (WIDTH - LEFT - RIGHT) / buckets as f64;
    for (i, bucket) in counts.iter().enumerate() {
        let mut y = top + height;
        for (k, colour) in [(0, "#4caf50"), (1, "#e53935"), (2, "#fb8c00")] {
            let h = height * f64::from(bucket[k]) / f64::from(most);
            if h > 0.0 {
                y -= h;
                let _ = writeln!(
                    out,
                    r#"<rect x="{:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" fill="{colour}"/>"#,
                    LEFT + bar * i as f64,
                    bar.max(1.0)
                );
            }
        }
    }
    let _ = writeln!(
        out,
        r#"<text x="4" y="{}">requests</text><text x="4" y="{}">per {} ms</text>"#,
        top + 12.0,
        top + 26.0,
        BUCKET.as_millis()
    );
    let _ = writeln!(
        out,
        "<text x=\"{LEFT}\" y=\"{}\" fill=\"#4caf50\">ok</text><text x=\"{}\" y=\"{}\" fill=\"#e53935\">failed</text><text x=\"{}\" y=\"{}\" fill=\"#fb8c00\">shed</text>",
        top - 6.0,
        LEFT + 30.0,
        top - 6.0,
        LEFT + 80.0,
        top - 6.0
    );
}

/// How many requests sent in each bucket were ok, failed and shed.
fn outcome_counts(records: &[RequestRecord], buckets: usize) -> Vec<[u32; 3]> {
    let mut counts = vec![[0u32; 3]; buckets];
    for r in records {
        let i = (r.sent.as_millis() / BUCKET.as_millis()) as usize;
        let k = match r.outcome {
            RequestOutcome::Ok => 0,
            RequestOutcome::Failed => 1,
            RequestOutcome::Shed => 2,
        };
        if let Some(bucket) = counts.get_mut(i) {
            bucket[k] += 1;
        }
    }
    counts
}

/// Time to first token p99 per second: y from 230 to 330.
fn draw_ttft(out: &mut String, axis: TimeAxis, records: &[RequestRecord], seconds: usize) {
    let (ttop, theight) = (230.0, 100.0);
    let p99s: Vec<Option<f64>> = (0..seconds)
        .map(|s| {
            let from = Duration::from_secs(s as u64);
            super::report::ttft_p99(records, from, from + Duration::from_secs(1))
        })
        .collect();
    let worst = p99s.iter().flatten().cloned().fold(1.0, f64::max);
    let points: Vec<String> = p99s
        .iter()
        .enumerate()
        .filter_map(|(s, p)| {
            p.map(|p| {
                format!(
                    "{:.1},{:.1}",
                    axis.x((s as f64 + 0.5) * 1000.0),
                    ttop + theight * (1.0 - p / worst)
                )
            })
        })
        .collect();
    let _ = writeln!(
        out,
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#1e88e5\" stroke-width=\"2\"/>",
        points.join(" ")
    );
    let _ = writeln!(
        out,
        r#"<text x="4" y="{}">TTFT p99</text><text x="4" y="{}">0-{worst:.0} ms</text>"#,
        ttop + 12.0,
        ttop + 26.0
    );
}

/// Every fault: a line where it struck, a faint band while it lasted.
fn draw_faults(out: &mut String, axis: TimeAxis, run: &RunReport) {
    for (i, fault) in run.faults.iter().enumerate() {
        let label = if fault.replicas == 0 {
            fault.fault.clone()
        } else {
            format!("{} of {}", fault.fault, fault.pool)
        };
        // Labels alternate between two rows, so that faults close together stay readable.
        let _ = writeln!(
            out,
            "<line x1=\"{0:.1}\" y1=\"30\" x2=\"{0:.1}\" y2=\"400\" stroke=\"#e53935\" stroke-dasharray=\"4 3\"/><text x=\"{1:.1}\" y=\"{2}\" fill=\"#e53935\">{3}</text>",
            axis.x(fault.at_ms),
            axis.x(fault.at_ms) + 3.0,
            if i % 2 == 0 { 412 } else { 426 },
            escape(&label)
        );
        if let Some(end) = fault.ended_ms {
            let _ = writeln!(
                out,
                "<rect x=\"{:.1}\" y=\"30\" width=\"{:.1}\" height=\"370\" fill=\"#e53935\" fill-opacity=\"0.06\"/>",
                axis.x(fault.at_ms),
                (axis.x(end) - axis.x(fault.at_ms)).max(1.0)
            );
        }
    }
}

/// The predicted window for detection beside the measured one. Detection is counted from the
/// first fault that struck replicas, as in the report.
fn draw_detection(out: &mut String, axis: TimeAxis, run: &RunReport, band: f64) {
    let Some(fault) = run.faults.iter().find(|f| f.replicas > 0) else {
        return;
    };
    if let Some([low, high]) = run.predicted_detection_ms {
        let _ = writeln!(
            out,
            "<rect x=\"{:.1}\" y=\"{band}\" width=\"{:.1}\" height=\"10\" fill=\"#bdbdbd\"/><text x=\"4\" y=\"{}\">predicted</text>",
            axis.x(fault.at_ms + low),
            (axis.x(fault.at_ms + high) - axis.x(fault.at_ms + low)).max(1.0),
            band + 9.0
        );
    }
    if let Some(detection) = run.detection_ms {
        let _ = writeln!(
            out,
            "<rect x=\"{:.1}\" y=\"{}\" width=\"{:.1}\" height=\"10\" fill=\"#757575\"/><text x=\"4\" y=\"{}\">detected</text>",
            axis.x(fault.at_ms),
            band + 14.0,
            (axis.x(fault.at_ms + detection) - axis.x(fault.at_ms)).max(1.0),
            band + 23.0
        );
    }
}

/// The promotion's steps as bands, one colour each.
fn draw_promotion(out: &mut String, axis: TimeAxis, run: &RunReport, band: f64) {
    for transition in &run.transitions {
        for (i, step) in transition.steps.iter().enumerate() {
            let colour = [
                "#3949ab", "#5e35b1", "#8e24aa", "#d81b60", "#00897b", "#43a047", "#7cb342",
            ][i % 7];
            let _ = writeln!(
                out,
                "<rect x=\"{:.1}\" y=\"{}\" width=\"{:.1}\" height=\"10\" fill=\"{colour}\"><title>{} {:.1} ms</title></rect>",
                axis.x(step.started_ms),
                band + 28.0,
                (axis.x(step.ended_ms) - axis.x(step.started_ms)).max(2.0),
                escape(&step.step),
                step.ended_ms - step.started_ms
            );
        }
        let _ = writeln!(out, "<text x=\"4\" y=\"{}\">promotion</text>", band + 37.0);
    }
}
