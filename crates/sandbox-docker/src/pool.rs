//! A pool of ready (created and started) containers per spec shape.
//!
//! A shape is everything a container is created with except its name: the
//! image (base or bootstrap snapshot), workdir, env, limits, network mode,
//! published sandbox ports, labels (the spec's and the session id) and
//! mounts. `create` takes a ready container of exactly its shape and renames
//! it to the name a fresh one would get; otherwise it creates one as before.
//! Either way the shape is then refilled in the background up to
//! [`DockerConfig::pool_size`](crate::DockerConfig::pool_size).
//!
//! A pooled container is named `harness-pool.<instance>-<random>` and
//! labelled `<prefix>.pool=<instance>` and `<prefix>.pool-owner=<marker>`
//! (boot id, pid namespace, pid and start time of the owning process). The
//! name is what says "still pooled": a taken container keeps its labels
//! (docker cannot change them) but gets the session's name, and only
//! containers whose name still starts with `harness-pool.` are ever removed
//! as pooled. See `docs/sandbox-docker.md` ("Pool") for the reasoning.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bollard::query_parameters::ListContainersOptionsBuilder;
use bollard::Docker;
use harness_core::sandbox::SandboxSpec;
use harness_core::Result;

use crate::{docker_err, DockerProvider};

/// The name prefix of a container that is still in the pool. No session
/// container's name can start with it: those are `harness-<name>-<suffix>`
/// with letters, digits, `-` and `_` only (a session id `pool` gives
/// `harness-pool-…`, hence the dot).
pub(crate) const POOL_NAME_PREFIX: &str = "harness-pool.";

/// What a shape's containers are made from.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub image: String,
    /// The spec, without slot and bootstrap (they do not reach the
    /// container's configuration).
    pub spec: SandboxSpec,
    pub extra_binds: Vec<String>,
    /// Whether the gate must be checked in each new container.
    pub check_gate: bool,
    /// How many forward directories of its own each container mounts: a
    /// shape pooled for any session (`forward_dirs`); 0 otherwise (the
    /// spec's own directories are in `extra_binds`).
    pub forward_dirs: usize,
    /// Whether each container gets an exec directory and its init starts
    /// the exec server in it (`exec_server`).
    pub exec_server: bool,
}

#[derive(Debug)]
struct Shape {
    plan: Arc<Plan>,
    ready: VecDeque<String>,
    filling: usize,
    last_used: u64,
}

#[derive(Debug, Default)]
struct State {
    closed: bool,
    /// Fills in flight over all shapes (also those of evicted shapes).
    in_flight: usize,
    shapes: HashMap<String, Shape>,
    tick: u64,
}

/// The pool of one provider (shared by its clones).
#[derive(Debug)]
pub(crate) struct Pool {
    pub instance: String,
    pub owner: String,
    size: usize,
    max_shapes: usize,
    /// [`DockerConfig::pool_refill_delay`](crate::DockerConfig::pool_refill_delay).
    refill_delay: Duration,
    label_pool: String,
    /// Directories of containers' own, swept when the pool goes: each
    /// root with the prefix of its entries' names
    /// ([`DockerConfig::pool_forward_dir`](crate::DockerConfig::pool_forward_dir),
    /// [`DockerConfig::exec_dir`](crate::DockerConfig::exec_dir)).
    swept: Vec<(std::path::PathBuf, &'static str)>,
    docker: Docker,
    state: Mutex<State>,
    changed: tokio::sync::Notify,
}

impl Pool {
    pub fn new(
        docker: Docker,
        label_pool: String,
        size: usize,
        max_shapes: usize,
        refill_delay: Duration,
        swept: Vec<(std::path::PathBuf, &'static str)>,
    ) -> Self {
        Self {
            instance: uuid::Uuid::new_v4().simple().to_string()[..12].to_string(),
            owner: owner_marker(),
            size,
            max_shapes: max_shapes.max(1),
            refill_delay,
            label_pool,
            swept,
            docker,
            state: Mutex::new(State::default()),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A ready container of shape `key`, if there is one.
    pub fn take(&self, key: &str) -> Option<String> {
        let mut state = self.state();
        if state.closed {
            return None;
        }
        state.tick += 1;
        let tick = state.tick;
        let shape = state.shapes.get_mut(key)?;
        shape.last_used = tick;
        shape.ready.pop_front()
    }

    /// Record `plan` as shape `key` (evicting the least recently used shape
    /// beyond `max_shapes`) and start filling it up to `size`.
    pub fn refill(self: &Arc<Self>, provider: &DockerProvider, key: &str, plan: Arc<Plan>) {
        let mut evicted = Vec::new();
        let to_start;
        {
            let mut state = self.state();
            if state.closed {
                return;
            }
            state.tick += 1;
            let tick = state.tick;
            if !state.shapes.contains_key(key) {
                while state.shapes.len() >= self.max_shapes {
                    let Some(oldest) = state
                        .shapes
                        .iter()
                        .min_by_key(|(_, s)| s.last_used)
                        .map(|(k, _)| k.clone())
                    else {
                        break;
                    };
                    if let Some(shape) = state.shapes.remove(&oldest) {
                        evicted.extend(shape.ready);
                    }
                }
                state.shapes.insert(
                    key.to_string(),
                    Shape {
                        plan: plan.clone(),
                        ready: VecDeque::new(),
                        filling: 0,
                        last_used: tick,
                    },
                );
            }
            let shape = state.shapes.get_mut(key).expect("inserted above");
            shape.last_used = tick;
            to_start = self.size.saturating_sub(shape.ready.len() + shape.filling);
            shape.filling += to_start;
            state.in_flight += to_start;
        }
        let plan = {
            let state = self.state();
            state.shapes.get(key).map(|s| s.plan.clone())
        };
        let Some(plan) = plan else { return };
        for _ in 0..to_start {
            let bare = provider.bare();
            let pool = Arc::downgrade(self);
            let key = key.to_string();
            let plan = plan.clone();
            let instance = self.instance.clone();
            let marks = self.marks();
            let delay = self.refill_delay;
            tokio::spawn(async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                    let open = pool.upgrade().is_some_and(|p| !p.state().closed);
                    if !open {
                        finish_fill(&bare, &pool, &key, None).await;
                        return;
                    }
                }
                let name = format!(
                    "{POOL_NAME_PREFIX}{instance}-{}",
                    &uuid::Uuid::new_v4().simple().to_string()[..10]
                );
                let made = bare.run_pooled(&plan, &name, &marks).await;
                finish_fill(&bare, &pool, &key, Some(made)).await;
            });
        }
        if !evicted.is_empty() {
            let bare = provider.bare();
            tokio::spawn(async move {
                for id in evicted {
                    let _ = bare.remove(&id).await;
                }
            });
        }
    }

    /// The labels of a pooled container.
    fn marks(&self) -> Vec<(String, String)> {
        vec![
            (self.label_pool.clone(), self.instance.clone()),
            (format!("{}-owner", self.label_pool), self.owner.clone()),
        ]
    }

    /// Ready containers, over all shapes.
    pub fn ready(&self) -> usize {
        self.state().shapes.values().map(|s| s.ready.len()).sum()
    }

    /// Wait until no fill is in flight (or `timeout` passes).
    pub async fn settled(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if self.state().in_flight == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    /// Close the pool: no more takes or fills; the ready containers, to be
    /// removed by the caller.
    fn close(&self) -> Vec<String> {
        let mut state = self.state();
        state.closed = true;
        state
            .shapes
            .values_mut()
            .flat_map(|s| s.ready.drain(..))
            .collect()
    }

    /// Close the pool and remove every container still in it, waiting for
    /// fills in flight. Returns how many were removed.
    pub async fn shutdown(&self, provider: &DockerProvider) -> Result<usize> {
        let ready = self.close();
        // A fill in flight sees the pool closed and removes its container
        // itself; wait for it so nothing appears after we return.
        self.settled(Duration::from_secs(60)).await;
        let mut removed = 0;
        for id in ready {
            provider.remove(&id).await?;
            removed += 1;
        }
        // Anything of this instance still named as pooled (a fill that
        // outlived the wait) goes too.
        for id in list_pooled(&self.docker, &self.label_pool, Some(&self.instance))
            .await?
            .into_iter()
            .map(|c| c.id)
        {
            provider.remove(&id).await?;
            removed += 1;
        }
        for (root, prefix) in &self.swept {
            crate::forward_dirs::sweep(&self.docker, root, prefix).await;
        }
        Ok(removed)
    }
}

impl Drop for Pool {
    /// Best effort: remove the containers still in the pool. The removal
    /// runs on a thread of its own with a fresh client (the caller's
    /// runtime may be the one blocked here, or shutting down), and the drop
    /// waits for it. A fill still in flight removes its container when it
    /// finishes, if its runtime lets it; what a crash or a cancelled fill
    /// leaves is reaped by the next provider (`reap_pool_leftovers`).
    fn drop(&mut self) {
        let already = {
            let state = self.state();
            state.closed && state.in_flight == 0
        };
        if already {
            // Shut down, and no fill in flight: nothing can be left.
            return;
        }
        let ready = self.close();
        let label = self.label_pool.clone();
        let instance = self.instance.clone();
        let swept = self.swept.clone();
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            let work = async move {
                let Ok(docker) = Docker::connect_with_local_defaults() else {
                    return;
                };
                let Ok(docker) = docker.negotiate_version().await else {
                    return;
                };
                let mut ids = ready;
                if let Ok(listed) = list_pooled(&docker, &label, Some(&instance)).await {
                    ids.extend(listed.into_iter().map(|c| c.id));
                }
                for id in ids {
                    let _ = crate::remove_container(&docker, &id).await;
                }
                for (root, prefix) in swept {
                    crate::forward_dirs::sweep(&docker, &root, prefix).await;
                }
            };
            // A hung engine must not hang the drop for ever.
            rt.block_on(async move {
                let _ = tokio::time::timeout(Duration::from_secs(30), work).await;
            });
        });
        let _ = cleanup.join();
    }
}

/// After a fill: hand the container to the pool, or remove it when the
/// pool is gone, closed, or no longer has the shape. `made` is `None` for
/// a fill given up before it began (the pool closed during its delay).
async fn finish_fill(
    bare: &DockerProvider,
    pool: &Weak<Pool>,
    key: &str,
    made: Option<Result<String>>,
) {
    let Some(pool) = pool.upgrade() else {
        if let Some(Ok(id)) = made {
            let _ = bare.remove(&id).await;
        }
        return;
    };
    let leftover = {
        let mut state = pool.state();
        state.in_flight = state.in_flight.saturating_sub(1);
        let closed = state.closed;
        match state.shapes.get_mut(key) {
            Some(shape) => {
                shape.filling = shape.filling.saturating_sub(1);
                match made {
                    Some(Ok(id)) if !closed => {
                        shape.ready.push_back(id);
                        None
                    }
                    Some(Ok(id)) => Some(id),
                    Some(Err(e)) => {
                        tracing::warn!("filling the docker sandbox pool failed: {e}");
                        None
                    }
                    None => None,
                }
            }
            None => made.and_then(Result::ok),
        }
    };
    if let Some(id) = leftover {
        let _ = bare.remove(&id).await;
    }
    pool.changed.notify_waiters();
}

/// A container the pool labels name.
#[derive(Debug)]
pub(crate) struct Pooled {
    pub id: String,
    pub owner: String,
    /// Exited or dead (not merely created: a fill in flight creates, then
    /// starts).
    pub exited: bool,
}

/// Containers labelled as pooled (by `instance`, or by any) whose name
/// still says they are in a pool.
pub(crate) async fn list_pooled(
    docker: &Docker,
    label: &str,
    instance: Option<&str>,
) -> Result<Vec<Pooled>> {
    let mut filters: HashMap<String, Vec<String>> = HashMap::new();
    filters.insert(
        "label".into(),
        vec![match instance {
            Some(i) => format!("{label}={i}"),
            None => label.to_string(),
        }],
    );
    let list = docker
        .list_containers(Some(
            ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await
        .map_err(|e| docker_err("listing pooled containers", e))?;
    let owner_label = format!("{label}-owner");
    Ok(list
        .into_iter()
        .filter(|c| {
            c.names
                .iter()
                .flatten()
                .any(|n| n.trim_start_matches('/').starts_with(POOL_NAME_PREFIX))
        })
        .filter_map(|c| {
            Some(Pooled {
                id: c.id?,
                owner: c
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(&owner_label).cloned())
                    .unwrap_or_default(),
                exited: matches!(
                    c.state,
                    Some(
                        bollard::models::ContainerSummaryStateEnum::EXITED
                            | bollard::models::ContainerSummaryStateEnum::DEAD
                    )
                ),
            })
        })
        .collect())
}

/// Who owns a pool: `<boot id>:<pid namespace>:<pid>:<start time>` (Linux;
/// `unknown` elsewhere or when /proc cannot tell).
pub(crate) fn owner_marker() -> String {
    marker_of(std::process::id()).unwrap_or_else(|| "unknown".into())
}

fn boot_id() -> Option<String> {
    Some(
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()?
            .trim()
            .to_string(),
    )
}

fn pid_namespace() -> Option<String> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let s = link.to_string_lossy();
    Some(
        s.trim_start_matches("pid:[")
            .trim_end_matches(']')
            .to_string(),
    )
}

/// The start time of `pid` (clock ticks after boot, field 22 of
/// `/proc/<pid>/stat`), which tells a reused pid from the original.
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // fields after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19).map(str::to_string)
}

/// The marker of process `pid` in this boot and pid namespace.
pub fn marker_of(pid: u32) -> Option<String> {
    Some(format!(
        "{}:{}:{pid}:{}",
        boot_id()?,
        pid_namespace()?,
        start_time(pid)?
    ))
}

/// Whether the owner a marker names is certainly gone: same boot and pid
/// namespace as this process (so its pid means the same process here), and
/// that pid no longer exists or belongs to a process started at another
/// time. A marker from another boot, machine or namespace says nothing.
pub(crate) fn owner_is_dead(marker: &str) -> bool {
    let mut parts = marker.split(':');
    let (Some(boot), Some(ns), Some(pid), Some(started)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    if Some(boot) != boot_id().as_deref() || Some(ns) != pid_namespace().as_deref() {
        return false;
    }
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    match start_time(pid) {
        None => true,
        Some(now) => now != started,
    }
}

/// Remove pooled containers nobody can take any more: those whose owner is
/// certainly dead, and exited ones (a live pool keeps its containers
/// running; an exited pooled container is useless to anyone, e.g. after a
/// reboot, and a pool that still lists one falls back to a fresh create
/// when it cannot take it). A merely created one may be a live pool's fill
/// between create and start: it is left to its owner. Returns how many
/// were removed.
pub(crate) async fn reap(provider: &DockerProvider, label: &str) -> Result<usize> {
    let mut removed = 0;
    for c in list_pooled(provider.client(), label, None).await? {
        if c.exited || owner_is_dead(&c.owner) {
            provider.remove(&c.id).await?;
            removed += 1;
        }
    }
    for (root, prefix) in crate::swept_dirs(provider.config()) {
        crate::forward_dirs::sweep(provider.client(), &root, prefix).await;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_an_exited_child_is_dead() {
        let me = owner_marker();
        assert_ne!(me, "unknown");
        assert!(!owner_is_dead(&me));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let marker = marker_of(child.id()).unwrap_or_else(|| {
            // Exited before we looked: build the marker by hand.
            format!(
                "{}:{}:{}:1",
                boot_id().unwrap(),
                pid_namespace().unwrap(),
                child.id()
            )
        });
        child.wait().unwrap();
        assert!(owner_is_dead(&marker), "{marker}");
        // A reused pid (same pid, other start time) is dead too.
        let parts: Vec<&str> = me.split(':').collect();
        let reused = format!("{}:{}:{}:0", parts[0], parts[1], parts[2]);
        assert!(owner_is_dead(&reused));
        // Another boot or namespace says nothing.
        assert!(!owner_is_dead(&format!("other-boot:{}:1:0", parts[1])));
        assert!(!owner_is_dead("unknown"));
    }
}
