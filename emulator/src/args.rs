//! `vllm serve`'s command line, read the way vLLM reads it.
//!
//! The emulator must be a drop-in for `vllm serve MODEL [flags]`, so this module accepts vLLM's
//! flag names in both `--x=y` and `--x y` forms, with `_` or `-` inside names as vLLM's
//! `FlexibleArgumentParser` does. Flags the emulator does not model are accepted and reported in
//! the `non-default args: {...}` log line, like vLLM reports every flag it was given. Settings that
//! exist only in the emulator start with `--emu-`; they are gathered here untyped and typed by
//! [`super::settings`]. This module must never read the environment or touch the network.

use std::fmt;

use super::Error;

/// A flag's value as vLLM's `non-default args` line prints it (a Python repr).
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    List(Vec<ArgValue>),
}

impl ArgValue {
    /// Types a raw command-line value the way argparse would for a flag of unknown type.
    fn infer(raw: &str) -> ArgValue {
        if let Ok(i) = raw.parse::<i64>() {
            ArgValue::Int(i)
        } else if let Ok(f) = raw.parse::<f64>() {
            ArgValue::Float(f)
        } else {
            match raw {
                "true" | "True" => ArgValue::Bool(true),
                "false" | "False" => ArgValue::Bool(false),
                _ => ArgValue::Str(raw.to_string()),
            }
        }
    }
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Str(s) => write!(f, "'{}'", s.replace('\\', "\\\\").replace('\'', "\\'")),
            ArgValue::Int(i) => write!(f, "{i}"),
            ArgValue::Float(x) => write!(f, "{x:?}"),
            ArgValue::Bool(true) => f.write_str("True"),
            ArgValue::Bool(false) => f.write_str("False"),
            ArgValue::List(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
        }
    }
}

/// The vLLM flags the emulator models, with vLLM's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeArgs {
    /// The positional `MODEL` (or `--model`): a Hugging Face repo id or a local path.
    pub model: String,
    /// `--host`; vLLM's default `None` listens on every address.
    pub host: Option<String>,
    pub port: u16,
    /// `--served-model-name`, one card in `/v1/models` each; empty means the model path.
    pub served_model_name: Vec<String>,
    pub max_model_len: Option<u32>,
    pub max_num_seqs: u32,
    pub block_size: u32,
    pub enable_sleep_mode: bool,
    pub enable_prefix_caching: bool,
    pub tensor_parallel_size: u32,
    pub dtype: String,
    pub gpu_memory_utilization: f64,
    pub enforce_eager: bool,
    pub revision: Option<String>,
    pub tokenizer: Option<String>,
    pub seed: i64,
    pub enable_force_include_usage: bool,
    pub api_key: Option<String>,
    /// `--disable-uvicorn-access-log`: no line per request.
    pub disable_uvicorn_access_log: bool,
    /// Every flag given, in order, as vLLM's `non-default args` line prints it.
    pub non_default: Vec<(String, ArgValue)>,
    /// Flags the emulator accepted but does not model (reported at startup).
    pub unmodelled: Vec<String>,
}

impl ServeArgs {
    fn new(model: String) -> ServeArgs {
        ServeArgs {
            model,
            host: None,
            port: 8000,
            served_model_name: Vec::new(),
            max_model_len: None,
            max_num_seqs: 256,
            block_size: 16,
            enable_sleep_mode: false,
            enable_prefix_caching: true,
            tensor_parallel_size: 1,
            dtype: "auto".to_string(),
            gpu_memory_utilization: 0.9,
            enforce_eager: false,
            revision: None,
            tokenizer: None,
            seed: 0,
            enable_force_include_usage: false,
            api_key: None,
            disable_uvicorn_access_log: false,
            non_default: Vec::new(),
            unmodelled: Vec::new(),
        }
    }

    /// The names clients use for the model: `--served-model-name`, else the model path.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model.clone()]
        } else {
            self.served_model_name.clone()
        }
    }

    /// The `non-default args: {...}` dict, with the API key redacted.
    pub fn non_default_repr(&self) -> String {
        let mut out = String::from("{");
        for (i, (name, value)) in self.non_default.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            if name == "api_key" {
                out.push_str("'api_key': '<redacted>'");
            } else {
                out.push_str(&format!("'{name}': {value}"));
            }
        }
        out.push('}');
        out
    }
}

/// A parsed `serve` command line: vLLM's flags, and the raw `--emu-*` settings in order.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandLine {
    pub serve: ServeArgs,
    /// `(key without the emu- prefix, value)`; a flag given without a value reads `true`.
    pub emu: Vec<(String, String)>,
}

/// Emulator settings that are switches.
const EMU_BOOLEAN_FLAGS: &[&str] = &["emu-instant", "emu-zero-cost"];

/// Parses `serve MODEL [flags]` (the program name already removed).
pub fn parse(argv: &[String]) -> Result<CommandLine, Error> {
    let mut rest = argv.iter().peekable();
    match rest.next().map(String::as_str) {
        Some("serve") => {}
        Some(other) => {
            return Err(Error::Usage(format!(
                "unknown command `{other}`; expected `serve`"
            )));
        }
        None => return Err(Error::Usage("missing command `serve`".to_string())),
    }
    let mut model: Option<String> = None;
    let mut flags: Vec<(String, Option<String>)> = Vec::new();
    let mut emu = Vec::new();
    while let Some(token) = rest.next() {
        let Some(body) = token.strip_prefix("--").or_else(|| short_alias(token)) else {
            if model.is_none() {
                model = Some(token.clone());
                continue;
            }
            return Err(Error::Usage(format!("unexpected argument `{token}`")));
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n.replace('_', "-"), Some(v.to_string())),
            None => (body.replace('_', "-"), None),
        };
        let takes_value =
            !understudy_core::vllm::is_switch(&name) && !EMU_BOOLEAN_FLAGS.contains(&name.as_str());
        let value = match inline {
            Some(v) => Some(v),
            // argparse nargs="+": every following token up to the next flag is a name.
            None if name == "served-model-name" => {
                let mut names = Vec::new();
                while let Some(next) = rest.next_if(|next| !next.starts_with('-')) {
                    names.push(next.clone());
                }
                (!names.is_empty()).then(|| names.join(" "))
            }
            None if takes_value && rest.peek().is_some_and(|next| !next.starts_with("--")) => {
                rest.next().cloned()
            }
            None => None,
        };
        if let Some(key) = name.strip_prefix("emu-") {
            emu.push((key.to_string(), value.unwrap_or_else(|| "true".to_string())));
        } else {
            flags.push((name, value));
        }
    }
    if let Some(pos) = flags.iter().position(|(n, _)| n == "model") {
        let (_, value) = flags.remove(pos);
        model = Some(value.ok_or_else(|| flag_error("model", "needs a value"))?);
    }
    let model = model.ok_or_else(|| Error::Usage("missing MODEL".to_string()))?;
    let mut serve = ServeArgs::new(model.clone());
    serve
        .non_default
        .push(("model_tag".to_string(), ArgValue::Str(model.clone())));
    for (name, value) in flags {
        apply_flag(&mut serve, &name, value)?;
    }
    serve
        .non_default
        .push(("model".to_string(), ArgValue::Str(model)));
    Ok(CommandLine { serve, emu })
}

fn short_alias(token: &str) -> Option<&'static str> {
    match token {
        "-tp" => Some("tensor-parallel-size"),
        "-pp" => Some("pipeline-parallel-size"),
        "-dp" => Some("data-parallel-size"),
        _ => None,
    }
}

fn flag_error(flag: &str, reason: impl Into<String>) -> Error {
    Error::Flag {
        flag: flag.to_string(),
        reason: reason.into(),
    }
}

fn required(flag: &str, value: Option<String>) -> Result<String, Error> {
    value.ok_or_else(|| flag_error(flag, "expected one argument"))
}

fn number<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, Error> {
    let raw = required(flag, value)?;
    raw.parse()
        .map_err(|_| flag_error(flag, format!("invalid value `{raw}`")))
}

fn apply_flag(serve: &mut ServeArgs, name: &str, value: Option<String>) -> Result<(), Error> {
    let key = name.replace('-', "_");
    let shown = match name {
        "host" => {
            let host = required(name, value)?;
            serve.host = Some(host.clone());
            ArgValue::Str(host)
        }
        "port" => {
            serve.port = number(name, value)?;
            ArgValue::Int(i64::from(serve.port))
        }
        "served-model-name" => {
            // argparse nargs="+" collected the names (`a,b` is one name to vLLM); a repeated flag
            // replaces the earlier names, as argparse's `store` does.
            let names = value.ok_or_else(|| flag_error(name, "expected at least one argument"))?;
            serve.served_model_name = names.split(' ').map(str::to_string).collect();
            ArgValue::List(
                serve
                    .served_model_name
                    .iter()
                    .cloned()
                    .map(ArgValue::Str)
                    .collect(),
            )
        }
        "max-model-len" => {
            let raw = required(name, value)?;
            serve.max_model_len =
                Some(parse_token_count(&raw).ok_or_else(|| flag_error(name, "invalid value"))?);
            ArgValue::Int(i64::from(serve.max_model_len.unwrap_or_default()))
        }
        "max-num-seqs" => {
            serve.max_num_seqs = number(name, value)?;
            if serve.max_num_seqs == 0 {
                return Err(flag_error(name, "must be at least 1"));
            }
            ArgValue::Int(i64::from(serve.max_num_seqs))
        }
        "block-size" => {
            serve.block_size = number(name, value)?;
            if serve.block_size == 0 {
                return Err(flag_error(name, "must be at least 1"));
            }
            ArgValue::Int(i64::from(serve.block_size))
        }
        "enable-sleep-mode" => {
            serve.enable_sleep_mode = bool_value(name, value)?;
            ArgValue::Bool(serve.enable_sleep_mode)
        }
        "enable-prefix-caching" | "no-enable-prefix-caching" => {
            let on = bool_value(name, value)?;
            serve.enable_prefix_caching = if name.starts_with("no-") { !on } else { on };
            return push(
                serve,
                "enable_prefix_caching",
                ArgValue::Bool(serve.enable_prefix_caching),
            );
        }
        "tensor-parallel-size" => {
            serve.tensor_parallel_size = number(name, value)?;
            ArgValue::Int(i64::from(serve.tensor_parallel_size))
        }
        "dtype" => {
            serve.dtype = required(name, value)?;
            ArgValue::Str(serve.dtype.clone())
        }
        "gpu-memory-utilization" => {
            serve.gpu_memory_utilization = number(name, value)?;
            ArgValue::Float(serve.gpu_memory_utilization)
        }
        "enforce-eager" => {
            serve.enforce_eager = bool_value(name, value)?;
            ArgValue::Bool(serve.enforce_eager)
        }
        "revision" => {
            serve.revision = Some(required(name, value)?);
            ArgValue::Str(serve.revision.clone().unwrap_or_default())
        }
        "tokenizer" => {
            serve.tokenizer = Some(required(name, value)?);
            ArgValue::Str(serve.tokenizer.clone().unwrap_or_default())
        }
        "seed" => {
            serve.seed = number(name, value)?;
            ArgValue::Int(serve.seed)
        }
        "enable-force-include-usage" => {
            serve.enable_force_include_usage = bool_value(name, value)?;
            ArgValue::Bool(serve.enable_force_include_usage)
        }
        "disable-uvicorn-access-log" => {
            serve.disable_uvicorn_access_log = bool_value(name, value)?;
            ArgValue::Bool(serve.disable_uvicorn_access_log)
        }
        "api-key" => {
            serve.api_key = Some(required(name, value)?);
            ArgValue::Str(serve.api_key.clone().unwrap_or_default())
        }
        _ => {
            serve.unmodelled.push(key.clone());
            match value {
                Some(raw) => ArgValue::infer(&raw),
                None => ArgValue::Bool(true),
            }
        }
    };
    push(serve, &key, shown)
}

fn push(serve: &mut ServeArgs, key: &str, value: ArgValue) -> Result<(), Error> {
    match serve.non_default.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => serve.non_default.push((key.to_string(), value)),
    }
    Ok(())
}

fn bool_value(flag: &str, value: Option<String>) -> Result<bool, Error> {
    match value.as_deref() {
        None | Some("true" | "True" | "1") => Ok(true),
        Some("false" | "False" | "0") => Ok(false),
        Some(other) => Err(flag_error(flag, format!("invalid boolean `{other}`"))),
    }
}

/// vLLM's `human_readable_int`: a plain integer, or a number with a unit suffix where lowercase
/// is decimal (`k` = 1000, `m`, `g`, `t`; decimals allowed, `25.6k` = 25600) and uppercase is
/// binary (`K` = 1024, `M`, `G`, `T`; whole numbers only).
fn parse_token_count(raw: &str) -> Option<u32> {
    let raw = raw.trim();
    let Some(suffix) = raw.chars().last().filter(char::is_ascii_alphabetic) else {
        return raw.parse().ok();
    };
    let number = &raw[..raw.len() - 1];
    let well_formed = match number.split_once('.') {
        Some((whole, frac)) => {
            !whole.is_empty()
                && !frac.is_empty()
                && [whole, frac]
                    .iter()
                    .all(|p| p.bytes().all(|b| b.is_ascii_digit()))
        }
        None => !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()),
    };
    if !well_formed {
        return None;
    }
    let value = match suffix {
        'k' | 'm' | 'g' | 't' => {
            let exponent = "kmgt".find(suffix)? as i32 + 1;
            // Python's int(float(number) * 10**n): truncates.
            (number.parse::<f64>().ok()? * 10f64.powi(3 * exponent)).trunc()
        }
        'K' | 'M' | 'G' | 'T' => {
            let exponent = "KMGT".find(suffix)? as i32 + 1;
            number.parse::<u64>().ok()? as f64 * 2f64.powi(10 * exponent)
        }
        _ => return None,
    };
    (value <= f64::from(u32::MAX)).then_some(value as u32)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn token_counts_read_lowercase_units_as_decimal_and_uppercase_as_binary() {
        assert_eq!(parse_token_count("4096"), Some(4096));
        assert_eq!(parse_token_count("1k"), Some(1000));
        assert_eq!(parse_token_count("1K"), Some(1024));
        assert_eq!(parse_token_count("32k"), Some(32_000));
        assert_eq!(parse_token_count("32K"), Some(32_768));
        assert_eq!(parse_token_count("25.6k"), Some(25_600));
        assert_eq!(parse_token_count("1m"), Some(1_000_000));
        assert_eq!(parse_token_count("1M"), Some(1_048_576));
        assert_eq!(parse_token_count("2g"), Some(2_000_000_000));
        assert_eq!(parse_token_count("1G"), Some(1 << 30));
    }

    #[test]
    fn token_counts_refuse_decimals_with_binary_units_and_what_vllm_refuses() {
        for bad in ["1.5K", "k", "1x", "1.k", ".5k", "1 k", "5G", "1t"] {
            assert_eq!(parse_token_count(bad), None, "{bad}");
        }
    }

    #[test]
    fn served_model_name_takes_every_name_up_to_the_next_flag_and_a_repeat_replaces() {
        let a = parse(&argv("serve m --served-model-name a b c --port 8001")).unwrap();
        assert_eq!(a.serve.served_model_name, ["a", "b", "c"]);
        assert_eq!(a.serve.port, 8001);
        let a = parse(&argv("serve m --served-model-name a --served-model-name b c")).unwrap();
        assert_eq!(a.serve.served_model_name, ["b", "c"]);
        let a = parse(&argv("serve --served-model-name=a m")).unwrap();
        assert_eq!(a.serve.served_model_name, ["a"]);
        assert_eq!(a.serve.model, "m");
        assert!(parse(&argv("serve m --served-model-name --port 1")).is_err());
    }

    #[test]
    fn both_flag_forms_and_underscored_names_are_read_alike() {
        let a = parse(&argv("serve m --port 8001 --max-model-len=4096 --max_num_seqs 8")).unwrap();
        assert_eq!(a.serve.port, 8001);
        assert_eq!(a.serve.max_model_len, Some(4096));
        assert_eq!(a.serve.max_num_seqs, 8);
    }

    #[test]
    fn unknown_flags_are_accepted_and_reported_like_vllm() {
        let a = parse(&argv(
            "serve Qwen/Qwen3-0.6B --enable-sleep-mode --kv-cache-dtype fp8 --port 8001",
        ))
        .unwrap();
        assert_eq!(
            a.serve.non_default_repr(),
            "{'model_tag': 'Qwen/Qwen3-0.6B', 'enable_sleep_mode': True, 'kv_cache_dtype': 'fp8', \
             'port': 8001, 'model': 'Qwen/Qwen3-0.6B'}"
        );
        assert_eq!(a.serve.unmodelled, vec!["kv_cache_dtype".to_string()]);
    }

    #[test]
    fn emulator_settings_are_kept_apart_from_vllm_flags() {
        let a = parse(&argv(
            "serve m --emu-instant --emu-fault crash@3s --emu-weights-gib=2",
        ))
        .unwrap();
        assert_eq!(
            a.emu,
            vec![
                ("instant".to_string(), "true".to_string()),
                ("fault".to_string(), "crash@3s".to_string()),
                ("weights-gib".to_string(), "2".to_string())
            ]
        );
        assert!(!a.serve.non_default_repr().contains("emu"));
    }

    #[test]
    fn the_api_key_is_never_printed() {
        let a = parse(&argv("serve m --api-key s3cret")).unwrap();
        assert!(!a.serve.non_default_repr().contains("s3cret"));
    }

    #[test]
    fn max_model_len_accepts_k_suffix_and_a_bad_number_is_an_error() {
        assert_eq!(
            parse(&argv("serve m --max-model-len 32k"))
                .unwrap()
                .serve
                .max_model_len,
            Some(32_000),
            "lowercase k is decimal in vLLM"
        );
        assert!(parse(&argv("serve m --port eighty")).is_err());
        assert!(parse(&argv("run m")).is_err());
        assert!(parse(&argv("serve")).is_err());
    }
}
