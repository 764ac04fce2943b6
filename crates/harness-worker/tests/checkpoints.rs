//! Checkpoints through the Worker's R2 binding (`src/checkpoints.rs`),
//! end to end: a tree checkpointed on a laptop (a local sandbox, core's move
//! pipeline with libzstd) is stored in the Worker's R2 bucket and restored
//! by the Worker itself into a sandbox of the test kit's bridge-compatible
//! server (real Docker); the Worker checkpoints that sandbox after a change
//! (core's pipeline in wasm32, pure-Rust zstd) and the laptop restores it.
//! Trees are compared through each sandbox's find/stat/sha256sum.
//!
//! The Worker runs with a checkpoint key (`HARNESS_CHECKPOINT_KEY`): what
//! it writes to R2 is encrypted in the Worker, in the laptop's lineage, and
//! the laptop — holding the same deployment key — encrypts its own
//! checkpoint before the upload and reads the Worker's. R2 holds no byte of
//! the trees (a marker file is searched for in every object); a checkpoint
//! copied into another lineage is refused, nothing restored.
//!
//! Real parts: `wrangler dev` (its local R2 bucket), Docker, the bridge's
//! OpenAPI document; without them it skips, or fails under
//! `HARNESS_REQUIRE_REAL=1`.

#![cfg(not(target_arch = "wasm32"))]

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_moves as moves;
use harness_testkit::bridge::{BridgeServer, BridgeServerConfig, OpenApi};
use harness_testkit::conformance::session_api::{self, CLIENT, HOST};
use harness_testkit::skip_or_fail;
use harness_testkit::trees::{listing, make_tree, sh};
use harness_testkit::wrangler::WranglerDev;
use sandbox_cloudflare::{CloudflareConfig, CloudflareProvider};
use sandbox_local::LocalProvider;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const BRIDGE_TOKEN: &str = "checkpoints-bridge-token";

/// The deployment's checkpoint key, the Worker's and the laptop's.
const CHECKPOINT_KEY: &str = "3f1e5c7a9b2d4f6081a3c5e7f9b1d3f5a7c9e1b3d5f7091b3d5f7a9c1e3b5d7f";

/// The lineage both sides write in.
const LINEAGE: &str = "laptop-l";

/// A file whose bytes must never reach R2: a marker amid random bytes (so
/// zstd keeps it as it is in a plain archive).
const MARKER: &str = "MARKER-9d2e-r2-must-never-read-this";

fn sealed(inner: Arc<dyn CheckpointStore>) -> checkpoint_crypt::EncryptedStore {
    let key = checkpoint_crypt::DeploymentKey::from_hex(CHECKPOINT_KEY).unwrap();
    checkpoint_crypt::EncryptedStore::new(inner, key.lineage(LINEAGE))
}

fn has_marker(bytes: &[u8]) -> bool {
    bytes.windows(MARKER.len()).any(|w| w == MARKER.as_bytes())
}

/// `HARNESS_CHECKPOINT_MAX_BYTES` for the test: 10 MiB.
const ROUTE_MAX_BYTES: u64 = 10 << 20;

async fn create(provider: &dyn SandboxProvider) -> Box<dyn Sandbox> {
    provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .expect("create sandbox")
}

async fn all_bytes(store: &dyn CheckpointStore, key: &str) -> Vec<u8> {
    let mut stream = store.get(key).await.expect("get");
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.expect("a verified chunk"));
    }
    out
}

/// `POST /v1/checkpoints/<op>` (`checkpoint` or `restore`) of `key` for
/// `sandbox`, in the Worker: its answer, asserted to be 200.
async fn move_in_worker(
    http: &reqwest::Client,
    dev: &WranglerDev,
    op: &str,
    sandbox: &dyn Sandbox,
    key: &str,
) -> Value {
    let answer = http
        .post(format!("{}/v1/checkpoints/{op}", dev.base))
        .bearer_auth(HOST)
        .json(&json!({"sandbox": sandbox.handle(), "dir": sandbox.workdir(), "key": key, "lineage": LINEAGE}))
        .send()
        .await
        .unwrap();
    let status = answer.status();
    let body: Value = answer.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 200, "{op} {key}: {body}\n{}", dev.log_tail());
    body
}

/// The object `key` as the Worker lists it and as it reads it back
/// through the object route, asserted to agree: the route's hash header,
/// the listing's hash and size, and the body's own.
async fn read_back(http: &reqwest::Client, objects: &str, key: &str) -> (Value, Bytes) {
    let listed: Value = http
        .get(format!("{objects}?prefix={key}"))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed = listed[0].clone();
    assert_eq!(listed["key"], key, "{listed}");
    let got = http
        .get(format!("{objects}/{key}"))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);
    let sha = got
        .headers()
        .get("x-checkpoint-sha256")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .expect("the recorded hash");
    let bytes = got.bytes().await.unwrap();
    assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
    assert_eq!(listed["sha256"], sha.as_str());
    assert_eq!(listed["size"], bytes.len() as u64);
    (listed, bytes)
}

/// The Worker restores `key` into `sandbox`, which then holds `expected`.
async fn restore_in_worker(
    http: &reqwest::Client,
    dev: &WranglerDev,
    sandbox: &dyn Sandbox,
    key: &str,
    expected: &[String],
) {
    let summary = move_in_worker(http, dev, "restore", sandbox, key).await;
    assert!(summary["entries"].as_u64().unwrap_or(0) > 10, "{summary}");
    assert_eq!(
        listing(sandbox, sandbox.workdir()).await,
        expected,
        "the sandbox holds the tree of {key}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_moves_laptop_to_a_cloudflare_sandbox_and_back_through_the_workers_r2() {
    let Some((docker, _gateway)) = harness_agent_e2e::docker_test_provider().await else {
        return;
    };
    let openapi = match OpenApi::pinned() {
        Ok(o) => o,
        Err(e) => {
            skip_or_fail(&format!("the bridge's OpenAPI document: {e:#}"));
            return;
        }
    };
    let bridge = BridgeServer::start(
        Arc::new(docker),
        BridgeServerConfig {
            token: BRIDGE_TOKEN.into(),
            spec: SandboxSpec::new("/workspace"),
            openapi: Some(openapi),
        },
    )
    .await
    .expect("the bridge server");
    let worker_dir = harness_testkit::wrangler::test_build();
    let vars = vec![
        ("HARNESS_TOKENS", session_api::token_table().to_string()),
        ("HARNESS_CF_BRIDGE_URL", bridge.url()),
        ("HARNESS_CF_TOKEN", BRIDGE_TOKEN.to_string()),
        // The object route buffers at most this much; a move in the Worker
        // streams its put in parts, and is not held to it.
        ("HARNESS_CHECKPOINT_MAX_BYTES", ROUTE_MAX_BYTES.to_string()),
        ("HARNESS_CHECKPOINT_KEY", CHECKPOINT_KEY.to_string()),
    ];
    let Some(dev) = tokio::task::spawn_blocking(move || WranglerDev::start(worker_dir, &vars))
        .await
        .expect("start task")
    else {
        return;
    };
    let http = reqwest::Client::new();
    let base = dev.base.clone();
    let objects = format!("{base}/v1/checkpoints/objects");

    // The laptop checkpoints natively (libzstd) into memory.
    let root = tempfile::tempdir().unwrap();
    let local = LocalProvider::new(root.path());
    let laptop = create(&local).await;
    make_tree(laptop.as_ref()).await;
    sh(
        laptop.as_ref(),
        &format!(
            "cd {} && head -c 3000 /dev/urandom > marked.bin && printf '%s' '{MARKER}' >> marked.bin && head -c 3000 /dev/urandom >> marked.bin",
            laptop.workdir()
        ),
    )
    .await;
    let start = listing(laptop.as_ref(), laptop.workdir()).await;
    // The control: a plain archive of this tree shows the marker.
    let plain = MemoryCheckpointStore::new();
    moves::checkpoint(
        laptop.as_ref(),
        laptop.workdir(),
        &plain,
        "plain.tar.zst",
        None,
    )
    .await
    .expect("the plain checkpoint");
    assert!(
        has_marker(&all_bytes(&plain, "plain.tar.zst").await),
        "the control shows no marker"
    );
    // The laptop encrypts on its side; what goes up is ciphertext.
    let memory: Arc<dyn CheckpointStore> = Arc::new(MemoryCheckpointStore::new());
    moves::checkpoint(
        laptop.as_ref(),
        laptop.workdir(),
        &sealed(memory.clone()),
        "laptop/tree.tar.zst",
        None,
    )
    .await
    .expect("the laptop's checkpoint");
    let made = memory.head("laptop/tree.tar.zst").await.unwrap();
    let archive = all_bytes(memory.as_ref(), "laptop/tree.tar.zst").await;
    assert!(!has_marker(&archive));
    let laptop_key = format!("lineages/{LINEAGE}/laptop/tree.tar.zst");

    // Into the Worker's bucket: only a host may write.
    let refused = put_object(&http, &objects, &laptop_key, CLIENT, archive.clone()).await;
    assert_eq!(refused.status(), 403);
    let put = put_object(&http, &objects, &laptop_key, HOST, archive.clone()).await;
    assert_eq!(put.status(), 200);
    let meta: Value = put.json().await.unwrap();
    assert_eq!(meta["sha256"], made.sha256.as_str(), "{meta}");
    assert_eq!(meta["size"], made.size, "{meta}");

    // The Worker restores it into a bridge sandbox, in the Worker.
    let cloud_provider = CloudflareProvider::new(CloudflareConfig::new(bridge.url(), BRIDGE_TOKEN))
        .expect("the native Cloudflare provider");
    let cloud = create(&cloud_provider).await;
    restore_in_worker(&http, &dev, cloud.as_ref(), &laptop_key, &start).await;
    // The same ciphertext in another lineage: another key, refused, and
    // nothing written into the sandbox.
    let elsewhere = "lineages/someone-else/laptop/tree.tar.zst";
    let copied = put_object(&http, &objects, elsewhere, HOST, archive.clone()).await;
    assert_eq!(copied.status(), 200);
    let untouched = create(&cloud_provider).await;
    let refused = http
        .post(format!("{}/v1/checkpoints/restore", dev.base))
        .bearer_auth(HOST)
        .json(&json!({"sandbox": untouched.handle(), "dir": untouched.workdir(), "key": elsewhere}))
        .send()
        .await
        .unwrap();
    let status = refused.status();
    let body: Value = refused.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 401, "{body}");
    assert!(body.to_string().contains("another key"), "{body}");
    assert!(
        listing(untouched.as_ref(), untouched.workdir())
            .await
            .is_empty(),
        "a refused restore wrote into the sandbox"
    );

    // A change in the cloud; the Worker checkpoints the sandbox (zstd in
    // wasm32) into its bucket.
    sh(
        cloud.as_ref(),
        &format!(
            "cd {} && echo changed-in-the-cloud > cloud-note.txt",
            cloud.workdir()
        ),
    )
    .await;
    let in_cloud = listing(cloud.as_ref(), cloud.workdir()).await;
    assert_ne!(in_cloud, start);
    let info = move_in_worker(
        &http,
        &dev,
        "checkpoint",
        cloud.as_ref(),
        "cloud/tree.tar.zst",
    )
    .await;
    assert!(
        info["tar_bytes"].as_u64().unwrap_or(0) > 6_000_000,
        "{info}"
    );
    // Encrypted in the Worker, in the lineage asked for.
    let cloud_key = format!("lineages/{LINEAGE}/cloud/tree.tar.zst");
    assert_eq!(info["object"]["key"], cloud_key.as_str(), "{info}");
    assert_eq!(info["encrypted"], true, "{info}");

    // Listed with its hash; read back, verified by the Worker and here;
    // the marker is in no object of the bucket.
    let (_, bytes) = read_back(&http, &objects, &cloud_key).await;
    let listed: Value = http
        .get(format!("{objects}?prefix="))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for object in listed.as_array().unwrap() {
        let key = object["key"].as_str().unwrap();
        let (_, raw) = read_back(&http, &objects, key).await;
        assert!(!has_marker(&raw), "{key} holds the marker");
    }

    // The laptop restores the Worker's checkpoint natively (libzstd reads
    // the Worker's frames).
    let memory_back: Arc<dyn CheckpointStore> = Arc::new(MemoryCheckpointStore::new());
    let stream: harness_core::stream::ByteStream =
        Box::pin(futures::stream::iter([Ok(Bytes::from(bytes.to_vec()))]));
    memory_back.put("cloud/tree.tar.zst", stream).await.unwrap();
    let laptop_back = create(&local).await;
    moves::restore(
        &sealed(memory_back),
        "cloud/tree.tar.zst",
        laptop_back.as_ref(),
        laptop_back.workdir(),
        None,
    )
    .await
    .expect("the laptop restores the Worker's checkpoint");
    assert_eq!(
        listing(laptop_back.as_ref(), laptop_back.workdir()).await,
        in_cloud,
        "the laptop holds the cloud's tree"
    );

    // A checkpoint larger than the route's buffer and than one 8 MiB part:
    // the Worker streams it into R2 as a multipart upload, its hash in a
    // trailer, and reads it back through the trailer (HEAD, list, GET and
    // a restore in the Worker).
    sh(
        cloud.as_ref(),
        &format!(
            "cd {} && head -c 12000000 /dev/urandom > noise.bin",
            cloud.workdir()
        ),
    )
    .await;
    let with_noise = listing(cloud.as_ref(), cloud.workdir()).await;
    let big = move_in_worker(
        &http,
        &dev,
        "checkpoint",
        cloud.as_ref(),
        "cloud/big.tar.zst",
    )
    .await;
    let big_key = format!("lineages/{LINEAGE}/cloud/big.tar.zst");
    assert_eq!(big["object"]["key"], big_key.as_str(), "{big}");
    // The object route answers what R2 holds: the ciphertext's size and
    // hash, not the content's the move answered.
    let big = &big["object"];
    assert!(big["size"].as_u64().unwrap_or(0) > ROUTE_MAX_BYTES, "{big}");
    let head = http
        .head(format!("{objects}/{big_key}"))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    let header = |name: &str| {
        head.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let stored_size = header("x-checkpoint-size")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert_eq!(
        stored_size,
        checkpoint_crypt::format::sealed_size(big["size"].as_u64().unwrap()),
        "{big}"
    );
    let (listed, bytes) = read_back(&http, &objects, &big_key).await;
    assert_eq!(
        header("x-checkpoint-sha256").as_deref(),
        listed["sha256"].as_str()
    );
    let cloud_back = create(&cloud_provider).await;
    restore_in_worker(&http, &dev, cloud_back.as_ref(), &big_key, &with_noise).await;
    // The same bytes through the object route: over its buffer, refused
    // before anything is stored.
    let too_big = put_object(&http, &objects, "laptop/big.tar.zst", HOST, bytes.to_vec()).await;
    assert_eq!(too_big.status(), 413);

    // Refusals: an unknown key, an unsafe key, a client grant.
    let missing = http
        .get(format!("{objects}/no/such.tar.zst"))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let unsafe_key = http
        .post(format!("{base}/v1/checkpoints/checkpoint"))
        .bearer_auth(HOST)
        .json(&json!({"sandbox": cloud.handle(), "dir": cloud.workdir(), "key": "../escape"}))
        .send()
        .await
        .unwrap();
    assert_eq!(unsafe_key.status(), 400);
    let client = http
        .get(format!("{objects}?prefix="))
        .bearer_auth(CLIENT)
        .send()
        .await
        .unwrap();
    assert_eq!(client.status(), 403);

    for sb in [laptop, cloud, laptop_back, cloud_back, untouched] {
        sb.destroy().await.unwrap();
    }
    bridge
        .check()
        .expect("every bridge request matched the OpenAPI document");
    drop(dev);
}

/// `PUT` `body` at `key` of the Worker's bucket route with `token`.
async fn put_object(
    http: &reqwest::Client,
    objects: &str,
    key: &str,
    token: &str,
    body: Vec<u8>,
) -> reqwest::Response {
    http.put(format!("{objects}/{key}"))
        .bearer_auth(token)
        .body(body)
        .send()
        .await
        .unwrap()
}
