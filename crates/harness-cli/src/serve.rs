//! `harness serve`: the session server over the CLI's SQLite log.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::server::{GrantRole, Scope, ServerConfig, TokenGrant};

use crate::home::Home;

/// `harness serve` arguments.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8787")]
    addr: String,
    /// A bearer token grant, `TOKEN=ROLE[@SESSION]` with ROLE one of
    /// client, runner, host and SESSION a session id or `*` (the default).
    /// Repeatable. Also read from $HARNESS_TOKENS (comma-separated).
    #[arg(long = "token", value_name = "TOKEN=ROLE[@SESSION]")]
    tokens: Vec<String>,
    /// Accept every request without a token (local development only).
    #[arg(long)]
    insecure_no_auth: bool,
    /// Stop an idle session's actor after this many seconds.
    #[arg(long, default_value_t = 30)]
    idle_secs: u64,
}

/// Parse `TOKEN=ROLE[@SESSION]`.
pub fn parse_grant(text: &str) -> Result<TokenGrant> {
    let (token, rest) = text
        .split_once('=')
        .context("a token grant looks like TOKEN=ROLE[@SESSION]")?;
    if token.len() < 16 {
        bail!(
            "token {:?}… is too short: use at least 16 characters",
            &token[..token.len().min(4)]
        );
    }
    let (role, scope) = rest.split_once('@').unwrap_or((rest, "*"));
    let role = match role {
        "client" => GrantRole::Client,
        "runner" => GrantRole::Runner,
        "host" => GrantRole::Host,
        other => bail!("unknown role {other:?}: use client, runner or host"),
    };
    Ok(TokenGrant::new(token, Scope::parse(scope)?, role))
}

/// Run the server until interrupted.
pub async fn run(home: &Home, args: ServeArgs) -> Result<()> {
    let log = Arc::new(
        harness::sqlite::SqliteSessionLog::open(home.db()).context("opening the session log")?,
    );
    let mut config = ServerConfig::new(log);
    let env_tokens = std::env::var("HARNESS_TOKENS").unwrap_or_default();
    for grant in args
        .tokens
        .iter()
        .map(String::as_str)
        .chain(env_tokens.split(',').filter(|s| !s.is_empty()))
    {
        config.tokens.push(parse_grant(grant)?);
    }
    config.insecure_no_auth = args.insecure_no_auth;
    config.idle_timeout = Duration::from_secs(args.idle_secs);
    if config.tokens.is_empty() && !config.insecure_no_auth {
        bail!("no tokens: pass --token TOKEN=host (and client/runner grants), or --insecure-no-auth for local development");
    }
    let listener = tokio::net::TcpListener::bind(&args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    eprintln!(
        "serving sessions on http://{} (log: {})",
        listener.local_addr()?,
        home.db().display()
    );
    tokio::select! {
        served = harness::server::serve(listener, config) => served.context("the server stopped")?,
        _ = tokio::signal::ctrl_c() => eprintln!("shutting down"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_parse_and_bad_ones_are_explained() {
        let g = parse_grant("0123456789abcdef=client@s-1").unwrap();
        assert_eq!(g.role, GrantRole::Client);
        assert_eq!(g.scope, Scope::parse("s-1").unwrap());
        assert_eq!(
            parse_grant("0123456789abcdef=host").unwrap().scope,
            Scope::All
        );
        assert!(parse_grant("short=host")
            .unwrap_err()
            .to_string()
            .contains("too short"));
        assert!(parse_grant("0123456789abcdef=admin")
            .unwrap_err()
            .to_string()
            .contains("unknown role"));
        assert!(parse_grant("no-equals").is_err());
    }
}
