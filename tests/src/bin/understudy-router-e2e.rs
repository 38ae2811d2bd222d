//! `understudy-router` for the end-to-end tests: the same command line as the router's own binary
//! (`understudy_router::cli`), built in this package so that the tests can start it as a process.

fn main() -> anyhow::Result<()> {
    understudy_router::cli::run(std::env::args_os())
}
