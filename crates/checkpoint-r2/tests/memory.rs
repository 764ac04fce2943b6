//! A 200 MB checkpoint goes up and comes back through the S3 store with
//! memory bounded by a few parts, not by the object's size. Alone in its
//! own test binary so no other test's allocations blur the measurement.

mod common;

use checkpoint_r2::DEFAULT_PART_SIZE;
use harness_core::checkpoint::CheckpointStore;

const MB: u64 = 1_000_000;

/// Peak resident memory of this process so far (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM line");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM value");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_megabytes_round_trip_in_bounded_memory() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let store =
        common::store_with(common::config(&ep, "memory").with_part_size(DEFAULT_PART_SIZE)).await;
    let total = 200 * MB;
    // Warm up the client (connection pool, TLS-free HTTP, SDK statics) so
    // the baseline includes what any use of the store costs.
    store
        .put("warmup", harness_core::stream::once(&b"w"[..]))
        .await
        .unwrap();
    let baseline = peak_rss();

    // The hash is computed from a second, independent generator so the
    // content is never held whole, not even by the test.
    let expected_sha = common::drain(common::generated_stream(42, total, 256 * 1024))
        .await
        .unwrap()
        .1;
    let started = std::time::Instant::now();
    let meta = store
        .put("big/200mb", common::generated_stream(42, total, 256 * 1024))
        .await
        .unwrap();
    let put_secs = started.elapsed().as_secs_f64();
    assert_eq!(
        (meta.size, meta.sha256.as_str()),
        (total, expected_sha.as_str())
    );
    let after_put = peak_rss();

    let started = std::time::Instant::now();
    let (size, sha) = common::drain(store.get("big/200mb").await.unwrap())
        .await
        .unwrap();
    let get_secs = started.elapsed().as_secs_f64();
    assert_eq!((size, sha.as_str()), (total, expected_sha.as_str()));
    let after_get = peak_rss();

    let grown = after_get.saturating_sub(baseline);
    println!(
        "200 MB: put {put_secs:.1}s ({:.0} MB/s), get {get_secs:.1}s ({:.0} MB/s); VmHWM baseline {} MiB, after put +{} MiB, after get +{} MiB",
        total as f64 / MB as f64 / put_secs,
        total as f64 / MB as f64 / get_secs,
        baseline >> 20,
        after_put.saturating_sub(baseline) >> 20,
        grown >> 20,
    );
    assert!(
        grown < 64 * 1024 * 1024,
        "peak memory grew by {} MiB moving 200 MB: the store is buffering",
        grown >> 20
    );
    store.delete("big/200mb").await.unwrap();
    store.delete("warmup").await.unwrap();
}
