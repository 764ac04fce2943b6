//! A tree re-checkpoint while the agent is still working: a changed file
//! removed between the listing and the read is recorded as deleted (the
//! checkpoint does not fail), and the other changes are kept, each in its
//! place in path order.

use async_trait::async_trait;
use harness_core::checkpoint::MemoryCheckpointStore;
use harness_core::clock::ManualClock;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_core::stream::ByteStream;
use harness_core::Result;
use harness_moves::tree as tc;
use harness_testkit::decorated::{Decorated, Decoration};
use sandbox_local::LocalProvider;

/// A real local sandbox that removes one file just before the changed
/// files are read: the agent deleting it after the listing.
#[derive(Debug)]
struct RemovesBeforeRead {
    victim: String,
}

#[async_trait]
impl Decoration for RemovesBeforeRead {
    async fn export_paths_tar(
        &self,
        inner: &dyn Sandbox,
        dir: &str,
        paths: &[String],
    ) -> Result<ByteStream> {
        assert!(
            paths.contains(&self.victim),
            "{} is among the files read ({paths:?})",
            self.victim
        );
        std::fs::remove_file(std::path::Path::new(dir).join(&self.victim)).unwrap();
        inner.export_paths_tar(dir, paths).await
    }
}

#[tokio::test]
async fn a_file_removed_between_the_listing_and_the_read_is_recorded_deleted() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let a = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    let b = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    let src = std::path::PathBuf::from(a.workdir());
    std::fs::create_dir_all(src.join("d")).unwrap();
    // Written a minute ago: not "racy" (modified in the second of the
    // listing), so an unchanged file is not read again.
    let a_minute_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    for name in ["a.txt", "b.txt", "c.txt", "d/e.txt", "z.txt"] {
        std::fs::write(src.join(name), format!("{name} v1")).unwrap();
        std::fs::File::options()
            .write(true)
            .open(src.join(name))
            .unwrap()
            .set_modified(a_minute_ago)
            .unwrap();
    }
    let store = MemoryCheckpointStore::new();
    let clock = ManualClock::at(1_000);
    let first = tc::checkpoint_tree(a.as_ref(), a.workdir(), &store, "t1", None, &clock, None)
        .await
        .unwrap();
    assert_eq!(first.entries, 6);
    tc::restore_tree(&store, "t1", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();

    // Three files change (longer, so they are read whatever the clock);
    // `c.txt` is then removed before it can be read.
    for name in ["b.txt", "c.txt", "z.txt"] {
        std::fs::write(src.join(name), format!("{name} version two")).unwrap();
    }
    let racing = Decorated {
        inner: a,
        decoration: RemovesBeforeRead {
            victim: "c.txt".to_string(),
        },
    };
    let second = tc::checkpoint_tree(
        &racing,
        racing.workdir(),
        &store,
        "t2",
        Some("t1"),
        &clock,
        None,
    )
    .await
    .expect("a file vanishing mid-checkpoint does not fail it");
    assert_eq!(second.files_read, 2, "b.txt and z.txt were read");
    assert_eq!(second.deleted, 1, "c.txt is recorded as deleted");

    let manifest = tc::read_manifest(&store, "t2").await.unwrap().unwrap();
    let paths: Vec<&str> = manifest.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["a.txt", "b.txt", "d", "d/e.txt", "z.txt"]);
    let deleted: Vec<&str> = manifest.deleted.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(deleted, ["c.txt"]);

    // Onto the first state: the two changes written, c.txt removed, the
    // rest untouched.
    let restored = tc::restore_tree(&store, "t2", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    assert_eq!(restored.written, 2);
    assert_eq!(restored.removed, 1);
    let dst = std::path::PathBuf::from(b.workdir());
    let read = |name: &str| std::fs::read_to_string(dst.join(name)).ok();
    assert_eq!(read("b.txt").as_deref(), Some("b.txt version two"));
    assert_eq!(read("z.txt").as_deref(), Some("z.txt version two"));
    assert_eq!(read("a.txt").as_deref(), Some("a.txt v1"));
    assert_eq!(read("d/e.txt").as_deref(), Some("d/e.txt v1"));
    assert_eq!(read("c.txt"), None);
}
