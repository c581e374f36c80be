//! On/off switches read from the environment: `1`, `true`, `yes`, `on` or `0`, `false`, `no`,
//! `off` (any case); unset or empty means the default. Anything else is a typed error naming
//! the variable and what its values do.

use crate::error::{NnError, Result};

/// Parses the value `v` of switch `var`; `meaning` says what 1 and 0 do (for the error).
pub fn parse_switch(var: &str, v: &str, default: bool, meaning: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" => Ok(default),
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(NnError::Config(format!(
            "{var}={other:?} is not a switch; use {meaning}"
        ))),
    }
}

/// The switch `var` as set in the environment now (see [`parse_switch`]).
pub fn switch(var: &str, default: bool, meaning: &str) -> Result<bool> {
    match std::env::var(var) {
        Ok(v) => parse_switch(var, &v, default, meaning),
        Err(_) => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_the_usual_spellings_and_refuse_others() {
        for v in ["1", "on", "TRUE", " yes "] {
            assert!(parse_switch("X", v, false, "1 or 0").unwrap());
        }
        for v in ["0", "Off", "false", "no"] {
            assert!(!parse_switch("X", v, true, "1 or 0").unwrap());
        }
        assert!(parse_switch("X", "", true, "1 or 0").unwrap());
        assert!(!parse_switch("X", " ", false, "1 or 0").unwrap());
        let e = parse_switch("CUDAGRAPH_X", "maybe", true, "1 (a) or 0 (b)").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("CUDAGRAPH_X=\"maybe\"") && msg.contains("1 (a) or 0 (b)"),
            "{msg}"
        );
    }
}
