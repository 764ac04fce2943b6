//! The one reconnect loop of the CLI's long-lived links to a server: the
//! runner channel of `harness runner` and the tool host's link of
//! `harness relay-host`. Run the link; when it ends, stop or wait and run
//! it again. The waits are `backon`'s exponential backoff from
//! [`FIRST_WAIT`], doubling up to the caller's cap, and start over after a
//! link that was up (a server restarted after a day of service is not
//! waited for as long as one that keeps refusing).

use std::future::Future;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// The wait after a link closed, and the first after a failure.
pub const FIRST_WAIT: Duration = Duration::from_millis(500);

/// How one run of a link ended.
#[derive(Debug)]
pub enum LinkEnd<T> {
    /// It was up, then closed (why): reconnect after [`FIRST_WAIT`].
    Closed(String),
    /// It could not be opened or failed (why): reconnect after a longer
    /// wait than the last.
    Failed(String),
    /// Stop reconnecting, with this.
    Stop(T),
}

/// The waits between runs of a link, capped at `max_wait`, endless.
fn waits(max_wait: Duration) -> impl Iterator<Item = Duration> {
    ExponentialBuilder::new()
        .with_min_delay(FIRST_WAIT)
        .with_max_delay(max_wait)
        .without_max_times()
        .build()
}

/// Run the link (`run`) until `ended`, told how a run ended, says stop;
/// says on stderr, prefixed with `what`, why it reconnects and when.
pub async fn keep_linked<R, T, Fut>(
    what: &str,
    max_wait: Duration,
    mut run: impl FnMut() -> Fut,
    mut ended: impl FnMut(R) -> LinkEnd<T>,
) -> T
where
    Fut: Future<Output = R>,
{
    let mut next_waits = waits(max_wait);
    loop {
        let why = match ended(run().await) {
            LinkEnd::Stop(result) => return result,
            LinkEnd::Closed(why) => {
                next_waits = waits(max_wait);
                why
            }
            LinkEnd::Failed(why) => why,
        };
        let wait = next_waits.next().unwrap_or(max_wait);
        eprintln!("{what}: {why}; reconnecting in {} ms", wait.as_millis());
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_to_their_cap() {
        let got: Vec<u128> = waits(Duration::from_secs(5))
            .take(7)
            .map(|w| w.as_millis())
            .collect();
        assert_eq!(got, [500, 1000, 2000, 4000, 5000, 5000, 5000]);
    }

    /// Failures wait longer each time; a link that was up starts the waits
    /// over; stop ends the loop with its value.
    #[tokio::test(start_paused = true)]
    async fn failures_back_off_and_a_closed_link_starts_over() {
        let ends = std::cell::RefCell::new(vec![
            LinkEnd::Failed("refused".into()),
            LinkEnd::Failed("refused".into()),
            LinkEnd::Failed("refused".into()),
            LinkEnd::Closed("closed".into()),
            LinkEnd::Failed("refused".into()),
            LinkEnd::Stop(7),
        ]);
        ends.borrow_mut().reverse();
        let started = tokio::time::Instant::now();
        let runs = std::cell::RefCell::new(Vec::new());
        let result = keep_linked(
            "test",
            Duration::from_secs(10),
            || {
                runs.borrow_mut().push(started.elapsed().as_millis());
                async {}
            },
            |()| ends.borrow_mut().pop().expect("no run after stop"),
        )
        .await;
        assert_eq!(result, 7);
        // Waits: 500, 1000, 2000 after the failures; 500 after the close;
        // then 1000 (the next of the fresh sequence) after a failure.
        assert_eq!(*runs.borrow(), [0, 500, 1500, 3500, 4000, 5000]);
    }
}
