//! The `SessionLeases` conformance suite: what the leases that put one
//! session's actor on one node at a time must do. Every backend's tests
//! call [`run_all`] with a factory of nodes over one fresh store: `node(name,
//! ttl)` is node `name`'s view of the same leases.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use harness_core::log::{Claim, SessionLeases};
use harness_core::SessionId;

/// Run every check; `nodes()` gives a fresh store and returns a maker of
/// its nodes.
pub async fn run_all<F, Fut, N>(nodes: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = N>,
    N: Fn(&str, Duration) -> Arc<dyn SessionLeases>,
{
    one_owner_at_a_time(nodes().await)
        .await
        .context("one_owner_at_a_time")?;
    an_expired_lease_moves_with_a_new_generation(nodes().await)
        .await
        .context("an_expired_lease_moves_with_a_new_generation")?;
    a_released_lease_moves_at_once(nodes().await)
        .await
        .context("a_released_lease_moves_at_once")?;
    a_node_renews_all_its_leases_at_once(nodes().await)
        .await
        .context("a_node_renews_all_its_leases_at_once")?;
    Ok(())
}

/// `renew_all` answers for each lease, in order: held ones are extended
/// (they outlive their first term), one another node took, one at a stale
/// generation and one never taken are not; an empty set is no error.
pub async fn a_node_renews_all_its_leases_at_once(
    node: impl Fn(&str, Duration) -> Arc<dyn SessionLeases>,
) -> Result<()> {
    let ttl = Duration::from_millis(900);
    let (a, b) = (node("http://node-a", ttl), node("http://node-b", ttl));
    let (s1, s2, s3, never) = (
        session("renew-all-1"),
        session("renew-all-2"),
        session("renew-all-3"),
        session("renew-all-never"),
    );
    for s in [&s1, &s2, &s3] {
        ensure!(matches!(
            a.acquire(s).await?,
            Claim::Owned { generation: 1, .. }
        ));
    }
    ensure!(a.renew_all(&[]).await?.is_empty(), "nothing to renew");
    // Past most of the first term: s1 and s2 renewed together; s3 left to
    // expire and taken by b.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let first = a.renew_all(&[(s1.clone(), 1), (s2.clone(), 1)]).await?;
    ensure!(first == [true, true], "both held: {first:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    ensure!(
        a.holder(&s1).await? == Some(("http://node-a".into(), 1, false)),
        "a renewed lease outlives its first term: {:?}",
        a.holder(&s1).await?
    );
    ensure!(
        matches!(b.acquire(&s3).await?, Claim::Owned { generation: 2, .. }),
        "the lease left unrenewed expired"
    );
    let answers = a
        .renew_all(&[
            (s1.clone(), 1),
            (s3.clone(), 1),
            (s2.clone(), 7),
            (never.clone(), 1),
            (s2.clone(), 1),
        ])
        .await?;
    ensure!(
        answers == [true, false, false, false, true],
        "held, taken, stale generation, never taken, held: {answers:?}"
    );
    Ok(())
}

fn session(name: &str) -> SessionId {
    SessionId::parse(name).expect("a session id")
}

/// A free lease goes to the first node that asks (generation 1, nothing
/// taken over); the others are told who holds it; the holder keeps it on
/// renewal and on asking again; leases of different sessions are apart.
pub async fn one_owner_at_a_time(
    node: impl Fn(&str, Duration) -> Arc<dyn SessionLeases>,
) -> Result<()> {
    let ttl = Duration::from_secs(30);
    let (a, b) = (node("http://node-a", ttl), node("http://node-b", ttl));
    ensure!(a.node() == "http://node-a" && a.ttl() == ttl);
    let s = session("one-owner");
    ensure!(
        a.holder(&s).await?.is_none(),
        "a lease nobody took has a holder"
    );
    let first = a.acquire(&s).await?;
    ensure!(
        first
            == Claim::Owned {
                generation: 1,
                taken_over: false
            },
        "a free lease: {first:?}"
    );
    let other = b.acquire(&s).await?;
    ensure!(
        other
            == Claim::Held {
                node: "http://node-a".into()
            },
        "a held lease names its holder: {other:?}"
    );
    ensure!(a.renew(&s, 1).await?, "the holder renews");
    ensure!(!b.renew(&s, 1).await?, "another node cannot renew it");
    ensure!(
        a.acquire(&s).await? == first,
        "asking again keeps the lease and its generation"
    );
    ensure!(
        a.holder(&s).await? == Some(("http://node-a".into(), 1, false)),
        "holder: {:?}",
        a.holder(&s).await?
    );
    let t = session("one-owner-2");
    ensure!(
        matches!(b.acquire(&t).await?, Claim::Owned { generation: 1, .. }),
        "another session's lease is free"
    );
    Ok(())
}

/// A lease not renewed within its time is an orphan and goes to the next
/// node that asks, with a greater generation and marked as taken over; the
/// old holder can no longer renew it.
pub async fn an_expired_lease_moves_with_a_new_generation(
    node: impl Fn(&str, Duration) -> Arc<dyn SessionLeases>,
) -> Result<()> {
    let ttl = Duration::from_millis(600);
    let (a, b) = (node("http://node-a", ttl), node("http://node-b", ttl));
    let s = session("expires");
    ensure!(matches!(
        a.acquire(&s).await?,
        Claim::Owned { generation: 1, .. }
    ));
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    let expired = b.holder(&s).await?;
    ensure!(
        expired == Some(("http://node-a".into(), 1, true)),
        "an expired lease shows as expired: {expired:?}"
    );
    ensure!(
        b.orphans(100).await?.contains(&s),
        "a lease that expired unreleased is an orphan"
    );
    let taken = b.acquire(&s).await?;
    ensure!(
        !b.orphans(100).await?.contains(&s),
        "a taken-over lease is no orphan"
    );
    ensure!(
        taken
            == Claim::Owned {
                generation: 2,
                taken_over: true
            },
        "taking an expired lease: {taken:?}"
    );
    ensure!(!a.renew(&s, 1).await?, "the old holder cannot renew it");
    ensure!(
        a.acquire(&s).await?
            == Claim::Held {
                node: "http://node-b".into()
            },
        "the old holder is told who holds it now"
    );
    Ok(())
}

/// A released lease is free at once; a release by a node that no longer
/// holds it changes nothing.
pub async fn a_released_lease_moves_at_once(
    node: impl Fn(&str, Duration) -> Arc<dyn SessionLeases>,
) -> Result<()> {
    let ttl = Duration::from_secs(30);
    let (a, b) = (node("http://node-a", ttl), node("http://node-b", ttl));
    let s = session("released");
    ensure!(matches!(
        a.acquire(&s).await?,
        Claim::Owned { generation: 1, .. }
    ));
    a.release(&s, 1).await?;
    ensure!(
        !b.orphans(100).await?.contains(&s),
        "a released lease is free, not an orphan"
    );
    let next = b.acquire(&s).await?;
    ensure!(
        matches!(next, Claim::Owned { generation: 2, .. }),
        "a released lease is free at once: {next:?}"
    );
    a.release(&s, 1).await?;
    ensure!(
        a.acquire(&s).await?
            == Claim::Held {
                node: "http://node-b".into()
            },
        "a stale release does not free the new holder's lease"
    );
    Ok(())
}
