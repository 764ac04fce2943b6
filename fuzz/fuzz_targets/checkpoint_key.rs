//! Checkpoint keys (`harness_core::checkpoint::validate_key`), the session
//! checkpoint keys built on them (`moves::SessionKeys`) and session ids
//! (`SessionId::parse`, whose ids end up in keys and URLs).
//!
//! Asserts: `validate_key` agrees with the documented rule (1–512 bytes of
//! `[A-Za-z0-9._/-]` in non-empty segments of at most 255 bytes that are not
//! `.` or `..`); an
//! accepted key joined under a directory stays under it; every key a
//! `SessionKeys` holds is itself valid; a valid session id makes valid keys
//! under `session_prefix` and never climbs (no `/`, no leading `.`).

#![no_main]

use std::path::{Component, Path};

use harness_core::checkpoint::{session_prefix, validate_key};
use harness_moves::SessionKeys;
use harness_core::SessionId;
use libfuzzer_sys::fuzz_target;

fn documented_rule(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 512
        && key.split('/').all(|seg| {
            !seg.is_empty()
                && seg.len() <= 255
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        })
}

fuzz_target!(|data: &[u8]| {
    let Ok(key) = std::str::from_utf8(data) else {
        return;
    };
    let ok = validate_key(key).is_ok();
    assert_eq!(ok, documented_rule(key), "validate_key({key:?}) = {ok}");
    if ok {
        let root = Path::new("/var/checkpoints");
        let joined = root.join(key);
        assert!(joined.starts_with(root));
        assert!(
            Path::new(key)
                .components()
                .all(|c| matches!(c, Component::Normal(_))),
            "{key:?} has a non-normal path component"
        );
    }

    if let Ok(keys) = SessionKeys::new(key) {
        assert!(ok, "SessionKeys accepted an invalid base {key:?}");
        for k in [&keys.work, &keys.state, &keys.manifest] {
            assert!(
                validate_key(k).is_ok(),
                "SessionKeys made an invalid key {k:?}"
            );
            assert!(k.starts_with(key) && k.len() > key.len());
        }
    }

    if let Ok(id) = SessionId::parse(key) {
        assert!(!id.as_str().contains('/') && !id.as_str().starts_with('.'));
        let prefix = session_prefix(&id);
        let object = format!("{prefix}turn-1/work.tar.zst");
        assert!(
            validate_key(&object).is_ok(),
            "{object:?} is not a valid key"
        );
        assert!(validate_key(prefix.trim_end_matches('/')).is_ok());
    }
});
