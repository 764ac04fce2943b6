//! `cargo xtask bench microvm`: boot-to-first-exec, exec round trip, file
//! throughput through the agent, and CPU-bound work against the host.
//! Needs QEMU and `cargo xtask microvm`; prints numbers, asserts nothing.

use std::time::{Duration, Instant};

use harness_core::sandbox::{collect_exec, ExecRequest, Sandbox, SandboxProvider, SandboxSpec};
use sandbox_microvm::{MicrovmConfig, MicrovmProvider};

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

async fn run(sb: &dyn Sandbox, script: &str) -> Duration {
    let t = Instant::now();
    let out = collect_exec(sb.exec(ExecRequest::shell(script)).await.unwrap())
        .await
        .unwrap();
    assert!(out.status.success(), "{script}: {}", out.stderr_str());
    t.elapsed()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let assets =
        std::env::var("HARNESS_MICROVM_ASSETS").unwrap_or_else(|_| format!("{cache}/microvm"));
    let state = tempfile::Builder::new()
        .prefix("mvmb")
        .tempdir_in("/tmp")
        .unwrap();
    let provider = MicrovmProvider::new(MicrovmConfig::from_assets(&assets, state.path()).unwrap());
    println!("accel: {}", provider.accel().await.as_str());

    let mut boots = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let t = Instant::now();
        let sb = provider.create(&SandboxSpec::new("/work")).await.unwrap();
        run(sb.as_ref(), "true").await;
        boots.push(t.elapsed());
        if let Some(old) = last.replace(sb) {
            let old: Box<dyn Sandbox> = old;
            old.destroy().await.unwrap();
        }
    }
    let sb = last.unwrap();
    println!(
        "boot to first exec (create + `true`, 3 boots): {}",
        boots.iter().map(|d| ms(*d)).collect::<Vec<_>>().join(", ")
    );

    let mut rts: Vec<Duration> = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let out = collect_exec(sb.exec(ExecRequest::new(["true"])).await.unwrap())
            .await
            .unwrap();
        assert!(out.status.success());
        rts.push(t.elapsed());
    }
    rts.sort();
    let mean = rts.iter().sum::<Duration>() / rts.len() as u32;
    println!(
        "exec round trip (`true`, 50 runs): p50 {}, p90 {}, max {}, mean {}",
        ms(rts[25]),
        ms(rts[45]),
        ms(rts[49]),
        ms(mean)
    );

    let mb = 32u64;
    let t = Instant::now();
    let body = harness_testkit::conformance::sandbox::generated_stream(mb << 20, 256 * 1024, 7);
    sb.write_file("big.bin", body).await.unwrap();
    let w = t.elapsed();
    let t = Instant::now();
    let data = harness_core::stream::collect(sb.read_file("big.bin").await.unwrap(), 64 << 20)
        .await
        .unwrap();
    let r = t.elapsed();
    assert_eq!(data.len() as u64, mb << 20);
    println!(
        "files through the agent ({mb} MiB): write {:.1} MB/s, read {:.1} MB/s",
        (mb << 20) as f64 / w.as_secs_f64() / 1e6,
        (mb << 20) as f64 / r.as_secs_f64() / 1e6
    );

    let loop_script = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done";
    let guest = run(sb.as_ref(), loop_script).await;
    let t = Instant::now();
    let st = std::process::Command::new("sh")
        .args(["-c", loop_script])
        .status()
        .unwrap();
    assert!(st.success());
    let host = t.elapsed();
    println!(
        "CPU-bound shell loop: guest {}, host {} ({:.1}x slower)",
        ms(guest),
        ms(host),
        guest.as_secs_f64() / host.as_secs_f64()
    );
    sb.destroy().await.unwrap();
}
