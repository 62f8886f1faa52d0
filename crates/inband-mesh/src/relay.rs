//! Responses the kernel path hands to the daemon (a slot in state USER):
//! chunked, close-delimited, 1xx, or a head not in its first segment. The
//! daemon reads the whole response from the pool socket, frames it with
//! httparse (head and chunk sizes), and writes it to the client through its
//! anchor connection, where the client reads it as if from the service.

use std::io;

use anyhow::{bail, Result};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The longest response head the daemon reads (the kernel path's is
/// INBAND_MESH_HEAD_MAX); longer is a broken backend.
const MAX_HEAD: usize = 64 * 1024;

/// How a relayed response ended.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// Framed and complete: the pool socket can take the next request.
    Reusable,
    /// Complete, but the backend closes (Connection: close) or the response
    /// ended with the connection: retire the socket, and, if `close_client`,
    /// close the client's connection too (its end marks the body's end).
    Retire { close_client: bool },
}

/// Reads what is available on `s` into `buf`; 0 at end of stream.
pub async fn read_some(s: &TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        s.readable().await?;
        match s.try_read(&mut chunk) {
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Relays one response from `backend` to `client` (None: the client is
/// gone; the response is read and dropped so the socket stays in step).
/// `head_request`: the request was HEAD, so the response has no body.
/// Returns the bytes written to the client with the outcome.
pub async fn relay<W: AsyncWriteExt + Unpin>(
    backend: &TcpStream,
    mut client: Option<&mut W>,
    head_request: bool,
    sent: &mut u64,
) -> Result<End> {
    let mut buf = Vec::with_capacity(16 * 1024);
    loop {
        // The head (and, for 1xx, the heads that follow it).
        let (head_len, status, framing, close) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 100];
            let mut res = httparse::Response::new(&mut headers);
            match res.parse(&buf)? {
                httparse::Status::Complete(n) => {
                    let status = res.code.unwrap_or(0);
                    let (framing, close) = framing(&res, head_request, status)?;
                    break (n, status, framing, close);
                }
                httparse::Status::Partial => {
                    if buf.len() > MAX_HEAD {
                        bail!("response head longer than {MAX_HEAD} bytes");
                    }
                    if read_some(backend, &mut buf).await? == 0 {
                        bail!("the backend closed before the response head ended");
                    }
                }
            }
        };
        forward(&mut client, &buf[..head_len], sent).await;
        buf.drain(..head_len);
        if (100..200).contains(&status) {
            if status == 101 {
                bail!("101 Switching Protocols on a pool socket (upgrades go by the anchor)");
            }
            continue;
        }
        return match framing {
            Framing::Length(n) => {
                let mut left = n;
                loop {
                    let take = (left as usize).min(buf.len());
                    forward(&mut client, &buf[..take], sent).await;
                    buf.drain(..take);
                    left -= take as u64;
                    if left == 0 {
                        break;
                    }
                    if read_some(backend, &mut buf).await? == 0 {
                        bail!("the backend closed with {left} body bytes to go");
                    }
                }
                if !buf.is_empty() {
                    bail!("{} bytes after the response's end", buf.len());
                }
                Ok(if close {
                    End::Retire {
                        close_client: false,
                    }
                } else {
                    End::Reusable
                })
            }
            Framing::Chunked => {
                chunked(backend, &mut client, &mut buf, sent).await?;
                Ok(if close {
                    End::Retire {
                        close_client: false,
                    }
                } else {
                    End::Reusable
                })
            }
            Framing::UntilClose => {
                forward(&mut client, &buf, sent).await;
                buf.clear();
                while read_some(backend, &mut buf).await? > 0 {
                    forward(&mut client, &buf, sent).await;
                    buf.clear();
                }
                Ok(End::Retire { close_client: true })
            }
        };
    }
}

enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

/// RFC 9112 §6.3, for a response to a request the daemon did not see.
fn framing(res: &httparse::Response, head_request: bool, status: u16) -> Result<(Framing, bool)> {
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut close = res.version == Some(0);
    for h in res.headers.iter() {
        let value = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            let n: u64 = value
                .parse()
                .map_err(|_| anyhow::anyhow!("bad Content-Length {value:?}"))?;
            if length.is_some_and(|l| l != n) {
                bail!("two different Content-Length values");
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
            if !chunked {
                return Ok((Framing::UntilClose, true));
            }
        } else if h.name.eq_ignore_ascii_case("connection") {
            close |= value
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("close"));
        }
    }
    let framing = if head_request || (100..200).contains(&status) || status == 204 || status == 304
    {
        Framing::Length(0)
    } else if chunked {
        Framing::Chunked
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    Ok((framing, close))
}

/// Forwards a chunked body through its last chunk and trailers.
async fn chunked<W: AsyncWriteExt + Unpin>(
    backend: &TcpStream,
    client: &mut Option<&mut W>,
    buf: &mut Vec<u8>,
    sent: &mut u64,
) -> Result<()> {
    loop {
        let (line, size) = loop {
            match httparse::parse_chunk_size(buf)
                .map_err(|_| anyhow::anyhow!("bad chunk size line"))?
            {
                httparse::Status::Complete((n, size)) => break (n, size),
                httparse::Status::Partial => {
                    if buf.len() > MAX_HEAD {
                        bail!("chunk size line longer than {MAX_HEAD} bytes");
                    }
                    if read_some(backend, buf).await? == 0 {
                        bail!("the backend closed inside a chunked body");
                    }
                }
            }
        };
        if size == 0 {
            // Trailers: lines up to an empty one, right after the size line.
            loop {
                if let Some(end) = trailers_end(&buf[line..]) {
                    forward(client, &buf[..line + end], sent).await;
                    let rest = buf.len() - (line + end);
                    if rest > 0 {
                        bail!("{rest} bytes after the chunked body's end");
                    }
                    buf.clear();
                    return Ok(());
                }
                if buf.len() > MAX_HEAD {
                    bail!("trailers longer than {MAX_HEAD} bytes");
                }
                if read_some(backend, buf).await? == 0 {
                    bail!("the backend closed inside the trailers");
                }
            }
        }
        // The chunk's data and its CRLF.
        let mut left = line as u64 + size + 2;
        loop {
            let take = (left as usize).min(buf.len());
            forward(client, &buf[..take], sent).await;
            buf.drain(..take);
            left -= take as u64;
            if left == 0 {
                break;
            }
            if read_some(backend, buf).await? == 0 {
                bail!("the backend closed inside a chunk");
            }
        }
    }
}

/// Length of the trailer section (through its empty line), if complete.
fn trailers_end(b: &[u8]) -> Option<usize> {
    if b.starts_with(b"\r\n") {
        return Some(2);
    }
    b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// Writes to the client if it is still there; a client that went away
/// mid-response stops receiving, the relay still reads to the end.
async fn forward<W: AsyncWriteExt + Unpin>(
    client: &mut Option<&mut W>,
    bytes: &[u8],
    sent: &mut u64,
) {
    if let Some(w) = client {
        if w.write_all(bytes).await.is_err() {
            *client = None;
        } else {
            *sent += bytes.len() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailers_end_after_the_empty_line() {
        assert_eq!(trailers_end(b"\r\n"), Some(2));
        assert_eq!(trailers_end(b"X-Sum: 1\r\n\r\n"), Some(12));
        assert_eq!(trailers_end(b"X-Sum: 1\r\n"), None);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn chunked_and_length_responses_are_relayed_byte_for_byte() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let responses: &[(&[u8], bool, End)] = &[
            (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", false, End::Reusable),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n", false, End::Reusable),
            (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", false, End::Reusable),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\n", true, End::Retire { close_client: false }),
        ];
        for (bytes, head, want) in responses {
            let bytes = bytes.to_vec();
            let (client, accepted) = tokio::join!(TcpStream::connect(addr), l.accept());
            let backend = client.unwrap();
            let (mut peer, _) = accepted.unwrap();
            // Sent in two pieces, split inside the head.
            peer.write_all(&bytes[..10]).await.unwrap();
            let rest = bytes[10..].to_vec();
            let writer = tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                peer.write_all(&rest).await.unwrap();
                peer
            });
            let mut out: Vec<u8> = Vec::new();
            let mut sent = 0;
            let end = relay(&backend, Some(&mut out), *head, &mut sent)
                .await
                .unwrap();
            let _peer = writer.await.unwrap();
            assert_eq!(&end, want);
            assert_eq!(out, *bytes);
            assert_eq!(sent, bytes.len() as u64);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_close_delimited_response_ends_with_the_connection() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (client, accepted) =
            tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
        let backend = client.unwrap();
        let (mut peer, _) = accepted.unwrap();
        peer.write_all(b"HTTP/1.1 200 OK\r\n\r\nbody until close")
            .await
            .unwrap();
        drop(peer);
        let mut out: Vec<u8> = Vec::new();
        let mut sent = 0;
        let end = relay(&backend, Some(&mut out), false, &mut sent)
            .await
            .unwrap();
        assert_eq!(end, End::Retire { close_client: true });
        assert_eq!(out, b"HTTP/1.1 200 OK\r\n\r\nbody until close");
    }
}
