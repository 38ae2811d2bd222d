//! understudy's end-to-end tests, which cross crates. The tests live in `tests/tests/`.
