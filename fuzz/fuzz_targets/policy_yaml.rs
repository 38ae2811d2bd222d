//! A FailoverPolicy manifest read offline (`simulate --policy`): YAML, the CRD's structural
//! schema, then every rule `validate` checks, and the Go durations in it. Anything is an error or
//! a policy; nothing panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use understudy_api::crd::FailoverPolicy;
use understudy_api::{policy, schema};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = understudy_core::duration::parse(text);
    let Ok(manifest) = schema::from_yaml::<FailoverPolicy>(text) else {
        return;
    };
    let _ = policy::validate(&manifest.spec);
});
