//! The wire format of the gate's exec server (`--exec-server SOCKET`): how
//! a host runs a command inside a container through a process already
//! there, instead of through the engine's exec API (`docs/sandbox-docker.md`,
//! "Commands through the exec server").
//!
//! One connection runs one command. Every message is a frame: a tag byte,
//! the payload's length (`u32`, big-endian), the payload. The host sends a
//! [`REQUEST`] first, then any number of [`STDIN`] frames and
//! [`STDIN_END`] when stdin is done. The server answers [`STARTED`] (the
//! command's process group id) once the command runs, [`STDOUT`] and
//! [`STDERR`] frames as it writes, and one [`EXIT`] frame (the exit code,
//! `i32` big-endian; `128 + N` for signal `N`) after it has exited and its
//! output has ended. A host that goes away ends the command's stdin and
//! nothing else: the command runs to its end, as under the engine's exec.
//!
//! A kill is a connection of its own: [`KILL`] with the group id, answered
//! by [`EXIT`] 0 (killed) or 1 (no such command running) — never stuck
//! behind stdin a command does not read.
//!
//! Both sides are here, once: the server in the gate's binary, the client
//! in `sandbox-docker`; only the framing is shared, each side does its own
//! I/O (blocking threads in the gate, tokio on the host).

/// Host → server, first: the [`Request`].
pub const REQUEST: u8 = b'q';
/// Host → server: bytes for the command's stdin.
pub const STDIN: u8 = b'i';
/// Host → server: the command's stdin is closed.
pub const STDIN_END: u8 = b'e';
/// Host → server, first and only on its connection: kill the process
/// group whose id (`u32`, big-endian) [`STARTED`] named.
pub const KILL: u8 = b'k';
/// Server → host, first: the command's process group id (`u32`,
/// big-endian).
pub const STARTED: u8 = b's';
/// Server → host: bytes the command wrote to stdout.
pub const STDOUT: u8 = b'o';
/// Server → host: bytes the command wrote to stderr.
pub const STDERR: u8 = b'r';
/// Server → host, last: the exit code (`i32`, big-endian).
pub const EXIT: u8 = b'x';

/// The largest payload either side sends or accepts in one frame.
pub const MAX_PAYLOAD: usize = 1 << 20;

/// A frame's header: its tag and its payload's length.
pub fn header(tag: u8, len: usize) -> [u8; 5] {
    debug_assert!(len <= MAX_PAYLOAD);
    let n = (len as u32).to_be_bytes();
    [tag, n[0], n[1], n[2], n[3]]
}

/// The tag and payload length of a header, or why it is not one.
pub fn parse_header(bytes: [u8; 5]) -> Result<(u8, usize), String> {
    let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(format!(
            "a frame of {len} bytes (tag {:?}) is over the {MAX_PAYLOAD}-byte limit",
            bytes[0] as char
        ));
    }
    Ok((bytes[0], len))
}

/// What to run. Strings are bytes: arguments, variables and paths need not
/// be UTF-8.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    /// Program and arguments (the program is looked up on `$PATH`).
    pub argv: Vec<Vec<u8>>,
    /// `NAME=value` entries added to the server's own environment (which
    /// is the container's, as the engine's exec would start from).
    pub env: Vec<Vec<u8>>,
    /// The working directory; `None`: the server's (`/`).
    pub cwd: Option<Vec<u8>>,
    /// Whether [`STDIN`] frames follow; otherwise stdin is empty.
    pub stdin: bool,
}

impl Request {
    /// The [`REQUEST`] frame's payload: a flag byte (bit 0: stdin, bit 1:
    /// a cwd follows), the cwd if any, the argument count and arguments,
    /// the entry count and entries — every string as its `u32` length and
    /// bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.push(u8::from(self.stdin) | (u8::from(self.cwd.is_some()) << 1));
        if let Some(cwd) = &self.cwd {
            put(&mut out, cwd);
        }
        for list in [&self.argv, &self.env] {
            out.extend_from_slice(&(list.len() as u32).to_be_bytes());
            for item in list {
                put(&mut out, item);
            }
        }
        out
    }

    /// The request in `payload`, or why it is malformed.
    pub fn decode(payload: &[u8]) -> Result<Self, String> {
        let mut rest = payload;
        let flags = *rest.first().ok_or("an empty request")?;
        rest = &rest[1..];
        let cwd = if flags & 2 != 0 {
            Some(take(&mut rest)?)
        } else {
            None
        };
        let mut lists = [Vec::new(), Vec::new()];
        for list in &mut lists {
            let n = take_u32(&mut rest)? as usize;
            // Each entry takes four bytes at least: a count beyond that is
            // a lie, and would reserve memory for nothing.
            if n > rest.len() / 4 {
                return Err(format!(
                    "a request lists {n} strings in {} bytes",
                    rest.len()
                ));
            }
            for _ in 0..n {
                list.push(take(&mut rest)?);
            }
        }
        if !rest.is_empty() {
            return Err(format!("{} bytes after the request", rest.len()));
        }
        let [argv, env] = lists;
        if argv.is_empty() {
            return Err("a request without a program".into());
        }
        Ok(Self {
            argv,
            env,
            cwd,
            stdin: flags & 1 != 0,
        })
    }
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn take_u32(rest: &mut &[u8]) -> Result<u32, String> {
    if rest.len() < 4 {
        return Err("a request cut short".into());
    }
    let n = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
    *rest = &rest[4..];
    Ok(n)
}

fn take(rest: &mut &[u8]) -> Result<Vec<u8>, String> {
    let n = take_u32(rest)? as usize;
    if rest.len() < n {
        return Err("a request cut short".into());
    }
    let (bytes, tail) = rest.split_at(n);
    *rest = tail;
    Ok(bytes.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_with_any_bytes() {
        let request = Request {
            argv: vec![b"sh".to_vec(), b"-c".to_vec(), vec![0xff, 0, b'x']],
            env: vec![b"A=1".to_vec(), b"B=".to_vec()],
            cwd: Some(b"/work dir".to_vec()),
            stdin: true,
        };
        assert_eq!(Request::decode(&request.encode()).unwrap(), request);
        let bare = Request {
            argv: vec![b"true".to_vec()],
            ..Request::default()
        };
        assert_eq!(Request::decode(&bare.encode()).unwrap(), bare);
    }

    #[test]
    fn malformed_requests_are_refused() {
        let good = Request {
            argv: vec![b"true".to_vec()],
            ..Request::default()
        }
        .encode();
        assert!(Request::decode(&[]).is_err());
        assert!(Request::decode(&good[..good.len() - 1]).is_err());
        let mut long = good.clone();
        long.push(0);
        assert!(Request::decode(&long).is_err());
        let no_program = Request::default().encode();
        assert!(Request::decode(&no_program)
            .unwrap_err()
            .contains("without a program"));
        // A count of four billion strings in a few bytes.
        let mut lie = vec![0u8];
        lie.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(Request::decode(&lie).unwrap_err().contains("lists"));
    }

    #[test]
    fn headers_round_trip_and_big_frames_are_refused() {
        assert_eq!(
            parse_header(header(STDOUT, 70_000)).unwrap(),
            (STDOUT, 70_000)
        );
        let mut big = header(STDIN, 0);
        big[1..].copy_from_slice(&((MAX_PAYLOAD as u32) + 1).to_be_bytes());
        assert!(parse_header(big).is_err());
    }
}
