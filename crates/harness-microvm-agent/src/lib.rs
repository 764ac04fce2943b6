//! The wire protocol between the `sandbox-microvm` provider (host) and its
//! guest agent (`harness-microvm-agent`, PID 1 in the guest), over one
//! virtio-serial port.
//!
//! A frame is `MAGIC` (4 bytes), the header length and the payload length
//! (each `u32`, little endian), a JSON header ([`Host`] or [`Guest`]) and
//! the raw payload (output or stdin bytes). A reader that finds anything
//! but `MAGIC` where a frame should start drops bytes until the next
//! `MAGIC`: a host process killed mid-frame leaves at most one torn frame
//! for the next connection to skip.
//!
//! Every connection starts with [`Host::Hello`]; the agent answers
//! [`Guest::Hello`] with the same nonce and kills whatever the previous
//! connection left running (its output has nowhere to go). Output and
//! stdin are flow controlled by credits: the agent sends at most
//! [`WINDOW`] bytes of an exec's output the host has not granted back with
//! [`Host::Credit`], and the host sends at most [`WINDOW`] bytes of stdin
//! the agent has not acknowledged with [`Guest::StdinCredit`].

use serde::{Deserialize, Serialize};

/// Start of every frame.
pub const MAGIC: [u8; 4] = *b"HMV1";
/// Largest header a reader accepts.
pub const MAX_HEADER: usize = 1 << 20;
/// Largest payload a reader accepts (writers send at most [`CHUNK`]).
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Size of the output chunks the agent reads and sends.
pub const CHUNK: usize = 64 * 1024;
/// Unacknowledged bytes allowed in flight per exec and direction.
pub const WINDOW: u64 = 1024 * 1024;
/// The virtio-serial port name the agent looks for.
pub const PORT_NAME: &str = "harness.agent";
/// Protocol version, sent in the agent's hello.
pub const VERSION: u32 = 1;
/// The address inside the guest where QEMU's `guestfwd` rules take host
/// forwards (user-mode networking); the agent relays `127.0.0.1:<port>`
/// to `FORWARD_ADDR:<port>` for every port in `harness.fwd=` on the kernel
/// command line.
pub const FORWARD_ADDR: &str = "10.0.2.100";

/// The ports of `harness.fwd=P1,P2,…` in a kernel command line.
pub fn forward_ports(cmdline: &str) -> Vec<u16> {
    cmdline
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("harness.fwd="))
        .flat_map(|v| v.split(','))
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Host to guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Host {
    /// A new connection; the agent answers with the same nonce.
    Hello { nonce: u64 },
    /// Start a process. `stdin`: whether [`Host::Stdin`] frames follow
    /// (else stdin is `/dev/null`).
    Exec {
        id: u64,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: String,
        stdin: bool,
    },
    /// Bytes for an exec's stdin (the payload); `eof` closes it after them.
    Stdin { id: u64, eof: bool },
    /// The host consumed `bytes` more of the exec's output.
    Credit { id: u64, bytes: u64 },
    /// Kill the exec's process group (SIGKILL).
    Kill { id: u64 },
    /// Flush the disks and power the VM off.
    Poweroff,
}

/// Guest to host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Guest {
    /// Answer to [`Host::Hello`].
    Hello { nonce: u64, version: u32 },
    /// The exec's process started.
    Started { id: u64, pid: i32 },
    /// The exec could not start (missing program, missing cwd, …); no
    /// other frame follows for this id.
    Failed { id: u64, message: String },
    /// Output on stdout (the payload).
    Stdout { id: u64 },
    /// Output on stderr (the payload).
    Stderr { id: u64 },
    /// The agent wrote `bytes` more of the exec's stdin.
    StdinCredit { id: u64, bytes: u64 },
    /// The process ended and its output is all sent. Last frame of the id.
    Exit {
        id: u64,
        code: Option<i32>,
        signal: Option<i32>,
    },
}

/// Encode one frame.
pub fn encode<T: Serialize>(header: &T, payload: &[u8]) -> Vec<u8> {
    let head = serde_json::to_vec(header).expect("protocol headers serialize");
    let mut out = Vec::with_capacity(12 + head.len() + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(payload);
    out
}

/// Incremental frame decoder: feed bytes with [`Decoder::push`], take frames
/// with [`Decoder::next_frame`].
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    start: usize,
    /// Bytes dropped while looking for a frame start.
    pub skipped: u64,
}

impl Decoder {
    /// A decoder with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append bytes read from the port.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start * 2 >= self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Forget everything buffered (a new connection).
    pub fn reset(&mut self) {
        self.buf.clear();
        self.start = 0;
    }

    /// The next complete frame, as its header and payload; headers that do
    /// not parse as `T` are skipped like garbage.
    pub fn next_frame<T: for<'de> Deserialize<'de>>(&mut self) -> Option<(T, Vec<u8>)> {
        loop {
            let avail = &self.buf[self.start..];
            if avail.len() < 12 {
                return None;
            }
            if avail[..4] != MAGIC {
                // Resynchronise: skip to the next possible magic.
                let skip = avail[1..]
                    .windows(4)
                    .position(|w| w == MAGIC)
                    .map(|p| p + 1)
                    .unwrap_or(avail.len().saturating_sub(3));
                self.start += skip;
                self.skipped += skip as u64;
                continue;
            }
            let hlen = u32::from_le_bytes(avail[4..8].try_into().expect("4 bytes")) as usize;
            let plen = u32::from_le_bytes(avail[8..12].try_into().expect("4 bytes")) as usize;
            if hlen > MAX_HEADER || plen > MAX_PAYLOAD {
                self.start += 1;
                self.skipped += 1;
                continue;
            }
            if avail.len() < 12 + hlen + plen {
                return None;
            }
            let header = serde_json::from_slice::<T>(&avail[12..12 + hlen]);
            let payload = avail[12 + hlen..12 + hlen + plen].to_vec();
            match header {
                Ok(h) => {
                    self.start += 12 + hlen + plen;
                    return Some((h, payload));
                }
                Err(_) => {
                    self.start += 1;
                    self.skipped += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_ports_come_from_the_command_line() {
        assert_eq!(
            forward_ports("quiet harness.net=user harness.fwd=47811,47812 x=1"),
            vec![47811, 47812]
        );
        assert!(forward_ports("quiet harness.net=none").is_empty());
    }

    #[test]
    fn frames_round_trip_split_anywhere_and_resync_after_garbage() {
        let a = encode(&Host::Hello { nonce: 7 }, b"");
        let b = encode(&Host::Stdin { id: 3, eof: true }, b"hello");
        let mut all = b"garbage HMV".to_vec();
        all.extend_from_slice(&a);
        all.extend_from_slice(&a[..9]); // a torn frame
        all.extend_from_slice(&b);
        for split in 0..all.len() {
            let mut d = Decoder::new();
            let mut got = Vec::new();
            d.push(&all[..split]);
            while let Some(f) = d.next_frame::<Host>() {
                got.push(f);
            }
            d.push(&all[split..]);
            while let Some(f) = d.next_frame::<Host>() {
                got.push(f);
            }
            assert_eq!(
                got,
                vec![
                    (Host::Hello { nonce: 7 }, vec![]),
                    (Host::Stdin { id: 3, eof: true }, b"hello".to_vec())
                ],
                "split at {split}"
            );
        }
    }
}
