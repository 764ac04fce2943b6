//! Who runs a session's actor: a lease per session in PostgreSQL, with a
//! generation that fences the previous owner.
//!
//! ```text
//! harness_leases (session PK, node, generation, expires_at)
//! ```
//!
//! - [`Leases::acquire`] takes a session's lease when it is free, expired,
//!   or already this node's; taking it from another node, or back after it
//!   expired (a restarted node's previous life), bumps the generation. Time is the database's (`now()`), so nodes' clocks never
//!   disagree about expiry.
//! - [`Leases::renew`] extends it while it is still this node's at the same
//!   generation; `false` once another node took it (the actor must stop).
//! - A log handle made with [`PostgresSessionLog::fenced`] checks, inside
//!   every append's transaction, that the session's lease row still names
//!   this node at the generation it acquired (the row is read `FOR SHARE`,
//!   so a takeover's update waits for the append, or the append sees the
//!   new owner): a node that lost its lease cannot append — its late
//!   writes are refused as `Fenced`, whatever its clock says.
//!
//! [`PostgresSessionLog::fenced`]: crate::PostgresSessionLog::fenced

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Pool, Transaction};
use harness_core::frame::SessionId;
use harness_core::log::{Claim, SessionLeases};
use harness_core::{Error, Result};

use crate::{client, db_err};

/// How long a lease lasts unless renewed; a dead node's sessions are taken
/// over once it has passed (docs/scale.md).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// A lease this node holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The session.
    pub session: SessionId,
    /// The owner's generation: it grows each time the lease changes node.
    pub generation: u64,
}

/// The leases of one node.
#[derive(Clone)]
pub struct Leases {
    pool: Pool,
    node: String,
    ttl: Duration,
    /// The generation this node holds per session (what fenced appends
    /// check against the row).
    held: Arc<Mutex<HashMap<SessionId, u64>>>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("node", &self.node)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}

impl Leases {
    pub(crate) fn new(pool: Pool, node: &str, ttl: Duration) -> Result<Self> {
        if node.is_empty() || node.len() > 200 {
            return Err(Error::invalid(
                "a node's name must be 1 to 200 bytes (it names the owner of its sessions)",
            ));
        }
        Ok(Self {
            pool,
            node: node.to_string(),
            ttl,
            held: Arc::default(),
        })
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// How long a lease lasts unless renewed.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Take `session`'s lease if it is free, expired or this node's;
    /// `None` while another node holds it.
    pub async fn acquire(&self, session: &SessionId) -> Result<Option<Lease>> {
        let client = client(&self.pool).await?;
        let row = client
            .query_opt(
                "INSERT INTO harness_leases (session, node, generation, expires_at) \
                 VALUES ($1, $2, 1, now() + make_interval(secs => $3::BIGINT / 1000.0)) \
                 ON CONFLICT (session) DO UPDATE SET \
                   generation = CASE WHEN harness_leases.node = excluded.node \
                                     AND harness_leases.expires_at > now() \
                                THEN harness_leases.generation \
                                ELSE harness_leases.generation + 1 END, \
                   node = excluded.node, expires_at = excluded.expires_at \
                 WHERE harness_leases.node = excluded.node OR harness_leases.expires_at <= now() \
                 RETURNING generation",
                &[&session.as_str(), &self.node, &ttl_ms(self.ttl)],
            )
            .await
            .map_err(db_err)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let generation = row.get::<_, i64>(0) as u64;
        self.held
            .lock()
            .expect("lease map")
            .insert(session.clone(), generation);
        Ok(Some(Lease {
            session: session.clone(),
            generation,
        }))
    }

    /// Extend `lease`; `false` when another node has taken it since (this
    /// node then holds it no more, and its appends are fenced).
    pub async fn renew(&self, lease: &Lease) -> Result<bool> {
        let client = client(&self.pool).await?;
        let changed = client
            .execute(
                "UPDATE harness_leases \
                 SET expires_at = now() + make_interval(secs => $4::BIGINT / 1000.0) \
                 WHERE session = $1 AND node = $2 AND generation = $3",
                &[
                    &lease.session.as_str(),
                    &self.node,
                    &(lease.generation as i64),
                    &ttl_ms(self.ttl),
                ],
            )
            .await
            .map_err(db_err)?;
        if changed == 0 {
            self.forget(lease);
        }
        Ok(changed == 1)
    }

    /// Extend every lease of `held` in one statement; for each, whether this
    /// node still holds it (one it lost is forgotten: its appends are
    /// fenced from now on).
    pub async fn renew_all(&self, held: &[Lease]) -> Result<Vec<bool>> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let sessions: Vec<&str> = held.iter().map(|l| l.session.as_str()).collect();
        let generations: Vec<i64> = held.iter().map(|l| l.generation as i64).collect();
        let client = client(&self.pool).await?;
        let rows = client
            .query(
                "UPDATE harness_leases \
                 SET expires_at = now() + make_interval(secs => $4::BIGINT / 1000.0) \
                 FROM unnest($2::TEXT[], $3::BIGINT[]) AS held(session, generation) \
                 WHERE harness_leases.session = held.session \
                   AND harness_leases.generation = held.generation \
                   AND harness_leases.node = $1 \
                 RETURNING harness_leases.session, harness_leases.generation",
                &[&self.node, &sessions, &generations, &ttl_ms(self.ttl)],
            )
            .await
            .map_err(db_err)?;
        let renewed: std::collections::HashSet<(&str, i64)> = rows
            .iter()
            .map(|r| (r.get::<_, &str>(0), r.get::<_, i64>(1)))
            .collect();
        let answers: Vec<bool> = held
            .iter()
            .map(|l| renewed.contains(&(l.session.as_str(), l.generation as i64)))
            .collect();
        for (lease, kept) in held.iter().zip(&answers) {
            if !kept {
                self.forget(lease);
            }
        }
        Ok(answers)
    }

    /// Give `lease` up at once (a clean shutdown): another node may take
    /// the session without waiting for it to expire. The row keeps its
    /// generation and names no node (`''`): a released lease is free, not
    /// an orphan.
    pub async fn release(&self, lease: &Lease) -> Result<()> {
        let client = client(&self.pool).await?;
        client
            .execute(
                "UPDATE harness_leases SET expires_at = now(), node = '' \
                 WHERE session = $1 AND node = $2 AND generation = $3",
                &[
                    &lease.session.as_str(),
                    &self.node,
                    &(lease.generation as i64),
                ],
            )
            .await
            .map_err(db_err)?;
        self.forget(lease);
        Ok(())
    }

    /// Who holds `session`'s lease: `(node, generation, expired)`.
    pub async fn owner(&self, session: &SessionId) -> Result<Option<(String, u64, bool)>> {
        let client = client(&self.pool).await?;
        let row = client
            .query_opt(
                "SELECT node, generation, expires_at <= now() FROM harness_leases \
                 WHERE session = $1",
                &[&session.as_str()],
            )
            .await
            .map_err(db_err)?;
        Ok(row.map(|r| (r.get(0), r.get::<_, i64>(1) as u64, r.get(2))))
    }

    /// Sessions whose lease expired without a release (their node died or
    /// stalled), the longest expired first.
    pub async fn orphans(&self, limit: usize) -> Result<Vec<SessionId>> {
        let client = client(&self.pool).await?;
        let rows = client
            .query(
                "SELECT session FROM harness_leases \
                 WHERE node <> '' AND expires_at <= now() \
                 ORDER BY expires_at LIMIT $1",
                &[&(limit.min(i64::MAX as usize) as i64)],
            )
            .await
            .map_err(db_err)?;
        rows.iter()
            .map(|r| SessionId::parse(r.get::<_, &str>(0)))
            .collect()
    }

    fn forget(&self, lease: &Lease) {
        let mut held = self.held.lock().expect("lease map");
        if held.get(&lease.session) == Some(&lease.generation) {
            held.remove(&lease.session);
        }
    }

    /// Inside an append's transaction: refuse unless `session`'s lease
    /// still names this node at the generation it acquired.
    pub(crate) async fn check(&self, tx: &Transaction<'_>, session: &SessionId) -> Result<()> {
        let generation = self.held.lock().expect("lease map").get(session).copied();
        let Some(generation) = generation else {
            return Err(Error::fenced(format!(
                "node {} holds no lease on session {session}: only its owner appends",
                self.node
            )));
        };
        let stmt = tx
            .prepare_cached(
                "SELECT node, generation FROM harness_leases WHERE session = $1 FOR SHARE",
            )
            .await
            .map_err(db_err)?;
        let row = tx
            .query_opt(&stmt, &[&session.as_str()])
            .await
            .map_err(db_err)?;
        match row {
            Some(r)
                if r.get::<_, &str>(0) == self.node && r.get::<_, i64>(1) as u64 == generation =>
            {
                Ok(())
            }
            Some(r) => Err(Error::fenced(format!(
                "node {} lost session {session} (generation {generation}) to node {} \
                 (generation {}): its appends are refused",
                self.node,
                r.get::<_, &str>(0),
                r.get::<_, i64>(1)
            ))),
            None => Err(Error::fenced(format!(
                "session {session} has no lease: node {} cannot append",
                self.node
            ))),
        }
    }
}

/// The hub's view of the leases (`harness_core::log::SessionLeases`).
#[async_trait]
impl SessionLeases for Leases {
    fn node(&self) -> &str {
        &self.node
    }

    fn ttl(&self) -> Duration {
        self.ttl
    }

    async fn acquire(&self, session: &SessionId) -> Result<Claim> {
        if let Some(lease) = Leases::acquire(self, session).await? {
            return Ok(Claim::Owned {
                generation: lease.generation,
                taken_over: lease.generation > 1,
            });
        }
        match self.owner(session).await? {
            Some((node, _, _)) => Ok(Claim::Held { node }),
            // Released and deleted between the two reads cannot happen
            // (rows are never deleted); say so rather than loop.
            None => Err(Error::backend(format!(
                "the lease of session {session} vanished while it was being taken"
            ))),
        }
    }

    async fn renew(&self, session: &SessionId, generation: u64) -> Result<bool> {
        Leases::renew(
            self,
            &Lease {
                session: session.clone(),
                generation,
            },
        )
        .await
    }

    async fn renew_all(&self, held: &[(SessionId, u64)]) -> Result<Vec<bool>> {
        let held: Vec<Lease> = held
            .iter()
            .map(|(session, generation)| Lease {
                session: session.clone(),
                generation: *generation,
            })
            .collect();
        Leases::renew_all(self, &held).await
    }

    async fn release(&self, session: &SessionId, generation: u64) -> Result<()> {
        Leases::release(
            self,
            &Lease {
                session: session.clone(),
                generation,
            },
        )
        .await
    }

    async fn holder(&self, session: &SessionId) -> Result<Option<(String, u64, bool)>> {
        self.owner(session).await
    }

    async fn orphans(&self, limit: usize) -> Result<Vec<SessionId>> {
        Leases::orphans(self, limit).await
    }
}
