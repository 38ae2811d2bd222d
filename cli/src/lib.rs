//! `kubectl understudy`: what a FailoverPolicy's status says, read for people, and the few
//! changes a person makes to a policy by hand.
//!
//! [`view`] turns objects as the API server returns them into tables and descriptions; [`act`]
//! turns a person's request into the patch that carries it (the command annotation the operator
//! consumes once, or `spec.paused`). Both are pure: the binary (`src/main.rs`) reads and writes
//! through the kubeconfig kubectl uses, asks for confirmation, and prints.

pub mod act;
pub mod table;
pub mod view;

/// How a command's answer is printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Columns for people.
    #[default]
    Table,
    /// The data behind the table, as JSON.
    Json,
    /// The data behind the table, as YAML.
    Yaml,
}

impl Output {
    /// `data` as this output prints it, or `table` for [`Output::Table`].
    ///
    /// # Errors
    /// When `data` cannot be serialized (it always can: it came from JSON).
    pub fn render(self, data: &serde_json::Value, table: impl FnOnce() -> String) -> anyhow::Result<String> {
        Ok(match self {
            Output::Table => table(),
            Output::Json => serde_json::to_string_pretty(data)? + "\n",
            Output::Yaml => serde_yaml::to_string(data)?,
        })
    }
}
