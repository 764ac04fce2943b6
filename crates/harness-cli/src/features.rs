//! What this build of `harness` has: optional backends are cargo features
//! (`docker`, `microvm`, `cloudflare`, `s3`, `temporal`, `postgres`, `otlp`, or `full`
//! for all), so the default build stays small for the demo and a laptop.
//! A command that needs a backend this build lacks says which feature
//! brings it, instead of failing in some other way.

/// The error for using `what`, which needs cargo feature `feature`.
#[allow(dead_code)] // unused when every feature is on
pub fn missing(feature: &str, what: &str) -> anyhow::Error {
    let has = if ENABLED.is_empty() {
        "none".to_string()
    } else {
        ENABLED.join(", ")
    };
    anyhow::anyhow!(
        "{what} needs the `{feature}` feature, which this build of harness does not have \
         (its optional features: {has}): build it with \
         `cargo install harness-cli --features {feature}` (or `--features full` for every \
         backend), or run `cargo run -p harness-cli --features {feature} -- …`"
    )
}

/// The optional features this build has.
const ENABLED: &[&str] = &[
    #[cfg(feature = "docker")]
    "docker",
    #[cfg(feature = "microvm")]
    "microvm",
    #[cfg(feature = "cloudflare")]
    "cloudflare",
    #[cfg(feature = "s3")]
    "s3",
    #[cfg(feature = "temporal")]
    "temporal",
    #[cfg(feature = "postgres")]
    "postgres",
    #[cfg(feature = "otlp")]
    "otlp",
];

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_feature_names_itself_and_how_to_get_it() {
        let e = super::missing("temporal", "`--engine temporal`").to_string();
        assert!(e.contains("`temporal` feature"), "{e}");
        assert!(e.contains("--features temporal"), "{e}");
        assert!(e.contains("--features full"), "{e}");
    }
}
