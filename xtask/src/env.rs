//! `cargo xtask env`: the environment the tests read to find the real parts.
//! `cargo xtask ci` passes exactly this to its test steps.

use crate::{agents, deps, image, microvm, services, util, worker};

/// `(KEY, VALUE)` pairs for the tests. With `require_real`, also
/// `HARNESS_REQUIRE_REAL=1`: tests then fail instead of skipping when a real
/// part is missing.
pub fn test_env(require_real: bool) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "HARNESS_CACHE".to_string(),
            util::cache_dir().display().to_string(),
        ),
        ("HARNESS_TEST_IMAGE".to_string(), image::IMAGE.to_string()),
    ];
    for agent in agents::AGENTS {
        match agent.find_installed() {
            Some(bin) => env.push((agent.env_bin.to_string(), bin.display().to_string())),
            None => eprintln!(
                "# {} not found: {} {} is not installed (cargo xtask agents)",
                agent.env_bin,
                agent.npm_package,
                agent.version()
            ),
        }
    }
    env.push((
        "HARNESS_S3_ENDPOINT".to_string(),
        format!("http://{}", services::S3_ADDR),
    ));
    env.push((
        "HARNESS_TEMPORAL_ADDRESS".to_string(),
        services::TEMPORAL_ADDR.to_string(),
    ));
    env.push((
        "HARNESS_TEST_POSTGRES_URL".to_string(),
        services::POSTGRES_URL.to_string(),
    ));
    // The bridge's OpenAPI document (`cargo xtask deps`), for the Cloudflare
    // provider's contract tests.
    env.push((
        "HARNESS_CF_OPENAPI".to_string(),
        deps::cf_openapi_path().display().to_string(),
    ));
    // The microVM guest (`cargo xtask microvm`), for sandbox-microvm.
    env.push((
        "HARNESS_MICROVM_ASSETS".to_string(),
        microvm::dir().display().to_string(),
    ));
    // wrangler (`cargo xtask worker deps`), for the Worker's test under
    // `wrangler dev`.
    env.push((
        "HARNESS_WRANGLER".to_string(),
        worker::wrangler_bin().display().to_string(),
    ));
    // Node 22 and pnpm (`cargo xtask deps`): the AI SDK's tests run on it,
    // and `harness serve` hands its directory to the sandboxes it makes.
    env.push((
        "HARNESS_NODE22".to_string(),
        crate::node::node_bin().display().to_string(),
    ));
    if require_real {
        env.push(("HARNESS_REQUIRE_REAL".to_string(), "1".to_string()));
    }
    env
}

pub fn print_exports(env: &[(String, String)]) {
    for (k, v) in env {
        println!("export {k}={}", shell_quote(v));
    }
}

fn shell_quote(v: &str) -> String {
    if !v.is_empty()
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-:=@+,".contains(c))
    {
        v.to_string()
    } else {
        format!("'{}'", v.replace('\'', r"'\''"))
    }
}
