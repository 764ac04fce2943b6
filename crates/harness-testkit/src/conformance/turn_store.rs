//! The `TurnStore` conformance suite: what an engine's durable turn state
//! must do, above all the fence (a save from an older engine generation
//! than the last one stored for that turn is refused with `Fenced`).
//! Every backend's tests call [`run_all`] with a factory of fresh stores.

use std::future::Future;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use harness_core::engine::TurnStore;
use harness_core::turn::{TurnState, TurnStatus};
use harness_core::ErrorKind;

/// A minimal turn state of `session`/`turn` at `cursor`.
pub fn state(session: &str, turn: &str, status: TurnStatus, cursor: u64) -> TurnState {
    let mut s: TurnState = serde_json::from_value(serde_json::json!({
        "version": 1,
        "session_id": session,
        "turn_id": turn,
        "agent": "claude-code",
        "prompt": "hi",
        "status": "not_started",
    }))
    .expect("a minimal turn state");
    s.status = status;
    // A terminal state here is one whose end was recorded too.
    s.end_recorded = status.is_terminal();
    s.cursor = cursor;
    s
}

/// Run every check against fresh stores from `factory`.
pub async fn run_all<F, Fut>(factory: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn TurnStore>>,
{
    round_trip_and_unfinished(factory().await)
        .await
        .context("round_trip_and_unfinished")?;
    stale_generation_is_fenced(factory().await)
        .await
        .context("stale_generation_is_fenced")?;
    concurrent_generations_keep_the_newest(factory().await)
        .await
        .context("concurrent_generations_keep_the_newest")?;
    Ok(())
}

/// A saved state loads back equal; a save replaces; `unfinished` lists the
/// turns whose next step is not `Done`.
pub async fn round_trip_and_unfinished(store: Arc<dyn TurnStore>) -> Result<()> {
    ensure!(
        store.load("s", "t1").await?.is_none(),
        "a fresh store has a state"
    );
    let t1 = state("s", "t1", TurnStatus::ReadyForNextStep, 4);
    store.save(&t1, 1).await?;
    store
        .save(&state("s", "t2", TurnStatus::NotStarted, 0), 1)
        .await?;
    store
        .save(&state("s", "t2", TurnStatus::Finished, 9), 1)
        .await?;
    ensure!(
        store.load("s", "t1").await?.as_ref() == Some(&t1),
        "t1 changed in a round trip"
    );
    let t2 = store.load("s", "t2").await?.context("t2 is gone")?;
    ensure!(
        t2.status == TurnStatus::Finished && t2.cursor == 9,
        "a save must replace: {t2:?}"
    );
    let unfinished: Vec<String> = store
        .unfinished()
        .await?
        .into_iter()
        .map(|s| s.turn_id)
        .collect();
    ensure!(unfinished == ["t1"], "unfinished gave {unfinished:?}");
    Ok(())
}

/// A save from an older generation than the last stored for the turn is
/// `Fenced` and changes nothing; the same generation saves again; a newer
/// one takes over; fencing is per turn.
pub async fn stale_generation_is_fenced(store: Arc<dyn TurnStore>) -> Result<()> {
    let at = |cursor| state("s", "t", TurnStatus::ReadyForNextStep, cursor);
    store.save(&at(10), 5).await?;
    store.save(&at(20), 6).await?;
    for (stale, cursor) in [(5, 11), (0, 12), (1, 13)] {
        match store.save(&at(cursor), stale).await {
            Err(e) if e.kind() == ErrorKind::Fenced => {}
            other => bail!(
                "a save from generation {stale} after generation 6 must be Fenced, got {other:?}"
            ),
        }
    }
    let kept = store.load("s", "t").await?.context("the state is gone")?;
    ensure!(
        kept.cursor == 20,
        "a fenced save changed the state (cursor {})",
        kept.cursor
    );
    store
        .save(&at(21), 6)
        .await
        .context("the current generation saves again")?;
    store
        .save(&at(30), 7)
        .await
        .context("a newer generation takes over")?;
    match store.save(&at(22), 6).await {
        Err(e) if e.kind() == ErrorKind::Fenced => {}
        other => bail!("generation 6 after 7 must be Fenced, got {other:?}"),
    }
    ensure!(
        store.load("s", "t").await?.map(|s| s.cursor) == Some(30),
        "the newest state was overwritten"
    );
    // Another turn, and the same turn id in another session, start fresh.
    store
        .save(&state("s", "other", TurnStatus::NotStarted, 1), 1)
        .await
        .context("another turn is not fenced by this one's generation")?;
    store
        .save(&state("s2", "t", TurnStatus::NotStarted, 1), 1)
        .await
        .context("the same turn id in another session is another turn")?;
    Ok(())
}

/// Engines of generations 1..=8 saving one turn at once: whatever the
/// order, the state of generation 8 is what stays, and generation 8's own
/// save is never fenced.
pub async fn concurrent_generations_keep_the_newest(store: Arc<dyn TurnStore>) -> Result<()> {
    let saves = (1..=8u64).map(|g| {
        let store = store.clone();
        tokio::spawn(async move {
            let mut last = Ok(());
            for round in 0..5 {
                tokio::task::yield_now().await;
                let s = state("race", "t", TurnStatus::ReadyForNextStep, g * 100 + round);
                last = store.save(&s, g).await;
                if last.is_err() {
                    break;
                }
            }
            (g, last)
        })
    });
    for joined in futures::future::join_all(saves).await {
        let (g, result) = joined.context("save task")?;
        match result {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Fenced && g < 8 => {}
            Err(e) => bail!("generation {g}: {e}"),
        }
    }
    let kept = store.load("race", "t").await?.context("no state")?;
    ensure!(
        kept.cursor == 804,
        "after the race the stored state is {} (generation {}), not generation 8's last",
        kept.cursor,
        kept.cursor / 100
    );
    match store
        .save(&state("race", "t", TurnStatus::ReadyForNextStep, 1), 7)
        .await
    {
        Err(e) if e.kind() == ErrorKind::Fenced => Ok(()),
        other => bail!("generation 7 after 8 must be Fenced, got {other:?}"),
    }
}
