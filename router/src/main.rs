//! `understudy-router`: the gateway (`gateway`) or the fence sidecar (`fence`). The command line
//! lives in the library ([`understudy_router::cli`]).

fn main() -> anyhow::Result<()> {
    understudy_router::cli::run(std::env::args_os())
}
