//! The understudy end-to-end test crate; its tests live in `tests/`.
