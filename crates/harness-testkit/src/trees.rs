//! A provider-neutral description of a working tree, read through the
//! sandbox's own `exec`, so trees can be compared across providers (local,
//! Docker, Cloudflare, …) after a move; and the test tree every move test
//! builds.

use harness_core::checkpoint::CheckpointStore;
use harness_core::sandbox::{collect_exec, shell_quote, ExecRequest, Sandbox};
use harness_moves as moves;
use std::path::Path;

/// Run a script that must succeed; its stdout.
pub async fn sh(sandbox: &dyn Sandbox, script: &str) -> String {
    let out = collect_exec(sandbox.exec(ExecRequest::shell(script)).await.unwrap())
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{script:?} failed: {:?} {}",
        out.status,
        out.stderr_str()
    );
    out.stdout_str()
}

/// Every entry under `dir`, sorted, one line each: `D path mode`,
/// `F path mode sha256`, `L path -> target`. Read with find/stat/sha256sum
/// in the sandbox itself, so it means the same on every provider.
pub async fn listing(sandbox: &dyn Sandbox, dir: &str) -> Vec<String> {
    let script = format!(
        r#"cd {} && find . -mindepth 1 | LC_ALL=C sort | while IFS= read -r f; do
  if [ -L "$f" ]; then printf 'L %s -> %s\n' "$f" "$(readlink "$f")"
  elif [ -d "$f" ]; then printf 'D %s %s\n' "$f" "$(stat -c %a "$f")"
  else printf 'F %s %s %s\n' "$f" "$(stat -c %a "$f")" "$(sha256sum < "$f" | cut -d' ' -f1)"
  fi
done"#,
        shell_quote(dir)
    );
    sh(sandbox, &script)
        .await
        .lines()
        .map(str::to_string)
        .collect()
}

/// Build the test tree under the sandbox's workdir with shell commands (the
/// same on every provider): nested text, a 6 MB random binary (several
/// parts at the 5 MiB part size even compressed), an executable, a
/// private file, relative symlinks to a file and a directory inside the
/// tree, an empty directory, names with spaces and non-ASCII.
pub async fn make_tree(sandbox: &dyn Sandbox) {
    let script = format!(
        r#"set -e
cd {wd}
mkdir -p src/deep/er empty 'with space/ü'
i=0; while [ $i -lt 40 ]; do
  j=0; : > src/deep/er/file$i.rs
  while [ $j -le $i ]; do echo "fn f$i() -> u32 {{ $j }}" >> src/deep/er/file$i.rs; j=$((j+1)); done
  i=$((i+1))
done
head -c 6000000 /dev/urandom > blob.bin
printf '#!/bin/sh\necho hi\n' > run.sh; chmod 755 run.sh
echo secret > private.key; chmod 600 private.key
echo 'ünïcode' > 'with space/ü/naïve name.txt'
ln -s src/deep/er/file3.rs link.rs
ln -s src/deep dir-link
echo 'from A' > shared.txt
"#,
        wd = shell_quote(sandbox.workdir())
    );
    sh(sandbox, &script).await;
}

/// Put the files the target has before the restore: one only B has (must
/// survive) and one both have (A's version wins).
pub async fn prepare_target(sandbox: &dyn Sandbox) {
    let script = format!(
        "set -e; cd {}; echo 'made in B' > b-only.txt; chmod 644 b-only.txt; echo 'old B version' > shared.txt",
        shell_quote(sandbox.workdir())
    );
    sh(sandbox, &script).await;
}

/// Assert B's tree is A's tree plus `b-only.txt`.
pub fn assert_overlaid(a: &[String], b: &[String]) {
    let b_only: Vec<&String> = b.iter().filter(|l| !a.contains(l)).collect();
    assert_eq!(b_only.len(), 1, "entries only in B: {b_only:#?}");
    assert!(
        b_only[0].starts_with("F ./b-only.txt 644 "),
        "{:?}",
        b_only[0]
    );
    let missing: Vec<&String> = a.iter().filter(|l| !b.contains(l)).collect();
    assert!(
        missing.is_empty(),
        "A's entries missing or different in B: {missing:#?}"
    );
    assert!(
        a.len() > 45,
        "the source tree is suspiciously small: {a:#?}"
    );
}

/// Move `a`'s tree onto `b` through `store` under `key` with the core move
/// pipeline and assert `b` = `a`'s tree + `b`'s own file (see
/// [`prepare_target`]); then remove that file again, so `b` can be the next
/// move's source with only `a`'s tree on it. Returns `b`'s listing after
/// the move.
pub async fn move_onto(
    a: &dyn Sandbox,
    b: &dyn Sandbox,
    store: &dyn CheckpointStore,
    key: &str,
) -> Vec<String> {
    prepare_target(b).await;
    let want = listing(a, a.workdir()).await;
    let info = moves::checkpoint(a, a.workdir(), store, key, None)
        .await
        .unwrap();
    assert!(info.tar_bytes > 6_000_000, "tar bytes {}", info.tar_bytes);
    moves::restore(store, key, b, b.workdir(), None)
        .await
        .unwrap();
    let got = listing(b, b.workdir()).await;
    assert_overlaid(&want, &got);
    sh(b, &format!("rm {}/b-only.txt", shell_quote(b.workdir()))).await;
    got
}

const WORDS: &[&str] = &[
    "fn", "let", "mut", "self", "impl", "struct", "enum", "match", "return", "async", "await",
    "pub", "use", "crate", "Result", "Option", "Some", "None", "Ok", "Err", "String", "Vec", "u64",
    "usize", "if", "else", "for", "in", "while", "loop", "break", "continue", "where", "trait",
    "dyn", "Box", "Arc", "clone", "into", "iter", "map", "collect", "unwrap", "expect", "config",
    "store", "key", "value", "buffer", "stream", "chunk", "error", "kind", "message",
];

/// xorshift64*: deterministic, fast.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The benchmarks' tree (`cargo xtask bench moves`, `fork`): write `files` files in directories of 100, ~`mb` MB in total,
/// 98% source-like text and 2% incompressible binaries (which carry ~20% of
/// the bytes, like assets and build outputs in a real repo).
pub fn generate_tree(root: &Path, files: usize, mb: u64) -> (usize, u64) {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let total = mb * 1_000_000;
    let binaries = (files / 50).max(1);
    let texts = files - binaries;
    let bin_bytes = total / 5;
    let text_avg = (total - bin_bytes) / texts as u64;
    let bin_avg = bin_bytes / binaries as u64;
    let mut written = 0u64;
    for i in 0..files {
        let dir = root.join(format!("pkg{:03}/mod{:02}", i / 1000, (i / 100) % 10));
        if i % 100 == 0 {
            std::fs::create_dir_all(&dir).unwrap();
        }
        let (name, data) = if i % 50 == 49 {
            let size = (bin_avg / 2 + rng.below(bin_avg)) as usize;
            let mut data = Vec::with_capacity(size + 8);
            while data.len() < size {
                data.extend_from_slice(&rng.next().to_le_bytes());
            }
            data.truncate(size);
            (format!("asset{i}.bin"), data)
        } else {
            let size = (text_avg / 2 + rng.below(text_avg)) as usize;
            let mut data = Vec::with_capacity(size + 64);
            let mut indent = 0usize;
            while data.len() < size {
                data.extend(std::iter::repeat_n(b' ', indent * 4));
                for _ in 0..(3 + rng.below(9)) {
                    data.extend_from_slice(
                        WORDS[rng.below(WORDS.len() as u64) as usize].as_bytes(),
                    );
                    data.push(b' ');
                }
                match rng.below(6) {
                    0 => {
                        data.extend_from_slice(b"{\n");
                        indent = (indent + 1).min(6);
                    }
                    1 if indent > 0 => {
                        data.extend_from_slice(b"}\n");
                        indent -= 1;
                    }
                    _ => data.extend_from_slice(b";\n"),
                }
            }
            data.truncate(size);
            (format!("file{i}.rs"), data)
        };
        written += data.len() as u64;
        std::fs::write(dir.join(name), data).unwrap();
    }
    (files, written)
}

/// A tar of `(path, kind, link target or content, mode)` entries, mtime
/// 1,700,000,000, directories included: what an import test feeds a sandbox.
pub fn tar_of(entries: &[(&str, tar::EntryType, &str, u32)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, kind, text, mode) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(*kind);
        header.set_mode(*mode);
        header.set_mtime(1_700_000_000);
        if *kind == tar::EntryType::Symlink {
            header.set_size(0);
            builder.append_link(&mut header, path, text).unwrap();
        } else if *kind == tar::EntryType::Directory {
            header.set_size(0);
            builder.append_data(&mut header, path, &b""[..]).unwrap();
        } else {
            header.set_size(text.len() as u64);
            builder
                .append_data(&mut header, path, text.as_bytes())
                .unwrap();
        }
    }
    builder.into_inner().unwrap()
}
