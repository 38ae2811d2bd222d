//! A route as the router's admin port takes it: JSON into the route contract, then its checks,
//! then the epoch judgement against a record. Bad routes are errors, never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use understudy_api::route::{HeldEpoch, Route};
use understudy_core::Epoch;
use understudy_router::highest_epoch::{DEFAULT_MAX_EPOCH_JUMP, judge};

fuzz_target!(|data: &[u8]| {
    let Ok(route) = serde_json::from_slice::<Route>(data) else {
        return;
    };
    if route.validate().is_err() {
        return;
    }
    let held = HeldEpoch {
        epoch: Epoch(7),
        pool: "a".to_owned(),
    };
    let _ = judge(
        Some(&held),
        route.epoch,
        &route.pool,
        Some(DEFAULT_MAX_EPOCH_JUMP),
    );
    let _ = judge(None, route.epoch, &route.pool, None);
    // What was taken serializes and reads back the same.
    let again: Route = serde_json::from_str(&serde_json::to_string(&route).unwrap_or_default())
        .unwrap_or_else(|e| panic!("a valid route does not read back: {e}"));
    assert_eq!(again, route);
});
