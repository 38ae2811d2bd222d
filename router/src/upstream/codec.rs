//! HTTP/1.1 as the gateway speaks it to an upstream: a request encoded into one buffer, a
//! response head parsed with `httparse`, and a response body decoded from the connection's read
//! buffer by the framing RFC 9112 §6.3 gives it (none, Content-Length, chunked, or until the
//! connection closes).
//!
//! Decoding is incremental: it takes whatever bytes have arrived and gathers every data byte at
//! hand into one piece, so a burst of SSE events read at once goes to the client as one frame.
//!
//! This module must never trust a length it has not checked, read past the end of the response it
//! is decoding, or forward a connection-scoped header.

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{
    CONNECTION, CONTENT_LENGTH, EXPECT, HOST, HeaderMap, HeaderName, HeaderValue, TRANSFER_ENCODING,
};
use http::{Method, StatusCode, Version};

/// The largest response head taken.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Header fields a response head may carry.
const MAX_HEADERS: usize = 128;
/// The longest chunk-size line (extensions included) or trailer field line.
const MAX_LINE_BYTES: usize = 4 * 1024;
/// The most trailer bytes skipped after the last chunk.
const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// A body at most this long is sent in the same write as the head (copied once); a longer one is
/// written after it from the buffer the gateway keeps for retries.
const INLINE_BODY_BYTES: usize = 16 * 1024;

/// What was wrong with a response, in words for the log and the client's 502.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub &'static str);

/// True for a header that belongs to one connection and is never forwarded. Standard names
/// compare as a tag, the two others as bytes: no name is parsed or hashed per request.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    use http::header::{PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER, UPGRADE};
    [
        CONNECTION,
        PROXY_AUTHENTICATE,
        PROXY_AUTHORIZATION,
        TE,
        TRAILER,
        TRANSFER_ENCODING,
        UPGRADE,
    ]
    .contains(name)
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// A request ready to go upstream.
#[derive(Debug)]
pub struct Outgoing {
    /// The request line, the header fields and, when short, the body.
    head: Vec<u8>,
    /// A long body, written after the head; empty when it went into `head`.
    body: Bytes,
}

impl Outgoing {
    /// Encodes a request for an endpoint named `host`: the request line in origin form with the
    /// client's `target`, the client's header fields less the connection-scoped ones, Host and
    /// Content-Length, then the endpoint's Host and the body's length.
    #[must_use]
    pub fn new(method: &Method, target: &str, headers: &HeaderMap, host: &HeaderValue, body: &Bytes) -> Self {
        let inline = body.len() <= INLINE_BODY_BYTES;
        let fields: usize = headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum();
        let mut head = Vec::with_capacity(64 + target.len() + fields + if inline { body.len() } else { 0 });
        for part in [
            method.as_str().as_bytes(),
            b" ",
            target.as_bytes(),
            b" HTTP/1.1\r\nhost: ",
        ] {
            head.extend_from_slice(part);
        }
        head.extend_from_slice(host.as_bytes());
        head.extend_from_slice(b"\r\n");
        let named = connection_options(headers.get_all(CONNECTION).iter().map(HeaderValue::as_bytes));
        for (name, value) in headers {
            // Expect: the whole body goes at once, so a 100 Continue would only delay the answer.
            if name == HOST
                || name == CONTENT_LENGTH
                || name == EXPECT
                || is_hop_by_hop(name)
                || is_named(&named, name)
            {
                continue;
            }
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        if !body.is_empty() || method == Method::POST {
            head.extend_from_slice(b"content-length: ");
            head.extend_from_slice(body.len().to_string().as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        if inline {
            head.extend_from_slice(body);
            return Outgoing {
                head,
                body: Bytes::new(),
            };
        }
        Outgoing {
            head,
            body: body.clone(),
        }
    }

    /// The bytes to write, in order.
    pub(super) fn parts(&self) -> [&[u8]; 2] {
        [&self.head, &self.body]
    }
}

/// How a response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// No body (204, 304).
    Empty,
    /// Content-Length bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Everything until the upstream closes the connection.
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    /// Status, version, and the header fields to forward (connection-scoped ones removed).
    pub parts: http::response::Parts,
    /// How the body is delimited.
    pub framing: Framing,
    /// Whether the connection may carry another request once the body has been read.
    pub keep_alive: bool,
}

/// Parses the response head at the front of `buf`, consuming it; `Ok(None)` while more bytes are
/// needed. Interim (1xx) responses are consumed and skipped.
pub fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Malformed> {
    loop {
        // Uninitialised slots: initialising 128 of them cost more than parsing a short head.
        let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut resp, buf, &mut slots)
        {
            Ok(httparse::Status::Complete(len)) if len > MAX_HEAD_BYTES => {
                return Err(Malformed("the response head is larger than 64 KiB"));
            }
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
                return Err(Malformed("the response head is larger than 64 KiB"));
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Malformed("the response head has more than 128 header fields"));
            }
            Err(_) => return Err(Malformed("the response head is not HTTP/1.x")),
        };
        let status = resp
            .code
            .and_then(|c| StatusCode::from_u16(c).ok())
            .ok_or(Malformed("the response status is not a number from 100 to 999"))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(Malformed("the upstream switched protocols"));
        }
        if status.is_informational() {
            buf.advance(len);
            continue;
        }
        let http11 = resp.version == Some(1);
        let mut named = Vec::new();
        let mut headers = HeaderMap::with_capacity(resp.headers.len());
        let mut length = None;
        let mut chunked = None;
        let mut close = !http11;
        for field in resp.headers.iter() {
            let name = HeaderName::from_bytes(field.name.as_bytes())
                .map_err(|_| Malformed("a response header name is not a token"))?;
            if name == TRANSFER_ENCODING {
                // The last coding decides: chunked last means chunked framing, anything else
                // means the body runs until the connection closes.
                chunked = Some(last_token(field.value).eq_ignore_ascii_case(b"chunked"));
                continue;
            }
            if name == CONNECTION {
                named.extend(connection_options(std::iter::once(field.value)));
                for token in field.value.split(|&b| b == b',').map(trim) {
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") && !http11 {
                        close = false;
                    }
                }
                continue;
            }
            if is_hop_by_hop(&name) {
                continue;
            }
            if name == CONTENT_LENGTH {
                let n = content_length(field.value)?;
                if length.is_some_and(|l| l != n) {
                    return Err(Malformed("the response has two different Content-Length values"));
                }
                length = Some(n);
            }
            let value = HeaderValue::from_bytes(field.value)
                .map_err(|_| Malformed("a response header value has a forbidden byte"))?;
            headers.append(name, value);
        }
        // Fields the Connection field names belong to this connection too (rare: looked up after).
        for option in named {
            if let Ok(name) = HeaderName::from_bytes(option) {
                headers.remove(name);
            }
        }
        let framing = if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Empty
        } else if let Some(chunked) = chunked {
            if length.is_some() {
                // RFC 9112 §6.3: Transfer-Encoding overrides Content-Length, which is removed
                // before forwarding, and the connection is not reused.
                headers.remove(CONTENT_LENGTH);
                close = true;
            }
            // RFC 9112 §6.1: Transfer-Encoding in an HTTP/1.0 message means the connection closes.
            close |= !http11;
            if chunked {
                Framing::Chunked
            } else {
                Framing::UntilClose
            }
        } else {
            match length {
                Some(0) => Framing::Empty,
                Some(n) => Framing::Length(n),
                None => Framing::UntilClose,
            }
        };
        let mut parts = http::Response::new(()).into_parts().0;
        parts.status = status;
        parts.version = if http11 {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        };
        parts.headers = headers;
        buf.advance(len);
        return Ok(Some(Head {
            parts,
            framing,
            keep_alive: !close && framing != Framing::UntilClose,
        }));
    }
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// The header names a Connection field lists besides `close` and `keep-alive`: fields that belong
/// to this connection and are not forwarded (RFC 9110 §7.6.1). Allocates only when there are some.
fn connection_options<'a>(values: impl Iterator<Item = &'a [u8]>) -> Vec<&'a [u8]> {
    let mut named = Vec::new();
    for value in values {
        named.extend(value.split(|&b| b == b',').map(trim).filter(|t| {
            !t.is_empty() && !t.eq_ignore_ascii_case(b"close") && !t.eq_ignore_ascii_case(b"keep-alive")
        }));
    }
    named
}

fn is_named(named: &[&[u8]], name: &HeaderName) -> bool {
    named
        .iter()
        .any(|t| t.eq_ignore_ascii_case(name.as_str().as_bytes()))
}

/// The last non-empty item of a comma-separated list.
fn last_token(value: &[u8]) -> &[u8] {
    value
        .rsplit(|&b| b == b',')
        .map(trim)
        .find(|t| !t.is_empty())
        .unwrap_or_default()
}

/// A Content-Length value: digits, or a list of the same digits repeated (RFC 9110 §8.6).
fn content_length(value: &[u8]) -> Result<u64, Malformed> {
    let mut found = None;
    for item in value.split(|&b| b == b',').map(trim) {
        let n = parse_digits(item, 10).ok_or(Malformed("the response's Content-Length is not a number"))?;
        if found.is_some_and(|f| f != n) {
            return Err(Malformed("the response has two different Content-Length values"));
        }
        found = Some(n);
    }
    found.ok_or(Malformed("the response's Content-Length is empty"))
}

/// An unsigned number in `radix` made of nothing but digits, or `None` (empty, other bytes, or
/// more than fits in 64 bits).
fn parse_digits(s: &[u8], radix: u32) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    s.iter().try_fold(0u64, |n, &b| {
        let d = char::from(b).to_digit(radix)?;
        n.checked_mul(u64::from(radix))?.checked_add(u64::from(d))
    })
}

/// Data decoded in one go: the first piece kept as it is (no copy), later ones copied after it.
#[derive(Debug, Default)]
pub struct Gathered {
    first: Option<Bytes>,
    more: BytesMut,
}

impl Gathered {
    /// Bytes gathered.
    #[must_use]
    pub fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.more.len()
    }

    /// True when nothing was gathered.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.first.is_none() && self.more.is_empty()
    }

    /// Adds a piece, without copying it when it is the first.
    pub fn push(&mut self, piece: Bytes) {
        if self.is_empty() {
            self.first = Some(piece);
        } else {
            self.extend(&piece);
        }
    }

    /// Makes room for `additional` more bytes to be copied in.
    pub fn reserve(&mut self, additional: usize) {
        self.more
            .reserve(self.first.as_ref().map_or(0, Bytes::len) + additional);
    }

    /// Copies `data` after what was gathered.
    pub fn extend(&mut self, data: &[u8]) {
        if let Some(first) = self.first.take() {
            self.more.reserve(first.len() + data.len());
            self.more.extend_from_slice(&first);
        }
        self.more.extend_from_slice(data);
    }

    /// Takes what was gathered, leaving nothing.
    pub fn take(&mut self) -> Bytes {
        match self.first.take() {
            Some(b) => b,
            None => self.more.split().freeze(),
        }
    }
}

/// Where the decoding of one response body stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decoder {
    state: State,
    trailer_bytes: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Bytes of a Content-Length body still to come.
    Length(u64),
    /// At a chunk-size line.
    ChunkSize,
    /// Bytes of the current chunk still to come.
    ChunkData(u64),
    /// At the CRLF that ends a chunk's data.
    ChunkEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
    /// Everything until the connection closes.
    UntilClose,
    /// The body has ended.
    Done,
}

impl Decoder {
    /// A decoder for a body framed by `framing`.
    #[must_use]
    pub fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::ChunkSize,
            Framing::UntilClose => State::UntilClose,
        };
        Decoder {
            state,
            trailer_bytes: 0,
        }
    }

    /// True once the body has ended.
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The exact number of body bytes still to come, when the framing says so.
    #[must_use]
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// The connection closed. True when that ends the body (it runs until the close); false when
    /// the body was cut.
    pub fn closed(&mut self) -> bool {
        match self.state {
            State::UntilClose | State::Done => {
                self.state = State::Done;
                true
            }
            _ => false,
        }
    }

    /// Moves the body's data at the front of `buf` into `out`, consuming the framing around it;
    /// stops when `buf` runs out, the body ends, or `out` holds `limit` bytes. Bytes after the
    /// body's end are left in `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut, out: &mut Gathered, limit: usize) -> Result<(), Malformed> {
        match self.state {
            State::Done => {}
            _ if buf.is_empty() || out.len() >= limit => {}
            State::Length(n) => {
                // As it arrived, without a copy.
                let take = n.min(buf.len() as u64);
                out.push(buf.split_to(take as usize).freeze());
                self.state = if take == n {
                    State::Done
                } else {
                    State::Length(n - take)
                };
            }
            State::UntilClose => out.push(buf.split().freeze()),
            _ => {
                // Chunked: walk the buffer, copy the data out, and consume what was walked once.
                out.reserve(buf.len());
                let (walked, result) = self.chunked(buf, out, limit);
                buf.advance(walked);
                return result;
            }
        }
        Ok(())
    }

    /// Decodes the chunked framing at the front of `bytes`; returns how many bytes it consumed.
    fn chunked(&mut self, bytes: &[u8], out: &mut Gathered, limit: usize) -> (usize, Result<(), Malformed>) {
        let mut at = 0;
        while at < bytes.len() && out.len() < limit {
            let rest = &bytes[at..];
            match self.state {
                State::ChunkSize => {
                    let line = match line(rest) {
                        Ok(Some(line)) => line,
                        Ok(None) => break,
                        Err(e) => return (at, Err(e)),
                    };
                    at += line.len() + 2;
                    match chunk_size(line) {
                        Ok(0) => self.state = State::Trailers,
                        Ok(size) => self.state = State::ChunkData(size),
                        Err(e) => return (at, Err(e)),
                    }
                }
                State::ChunkData(n) => {
                    let take = n.min(rest.len() as u64);
                    out.extend(&rest[..take as usize]);
                    at += take as usize;
                    self.state = if take == n {
                        State::ChunkEnd
                    } else {
                        State::ChunkData(n - take)
                    };
                }
                State::ChunkEnd => match rest {
                    [b'\r', b'\n', ..] => {
                        at += 2;
                        self.state = State::ChunkSize;
                    }
                    [b'\r'] => break,
                    _ => return (at, Err(Malformed("a chunk's data is longer than its size"))),
                },
                State::Trailers => {
                    let line = match line(rest) {
                        Ok(Some(line)) => line,
                        Ok(None) => break,
                        Err(e) => return (at, Err(e)),
                    };
                    at += line.len() + 2;
                    if line.is_empty() {
                        self.state = State::Done;
                        break;
                    }
                    // Trailer fields are skipped: vLLM sends none, and none is forwarded.
                    self.trailer_bytes += line.len() + 2;
                    if self.trailer_bytes > MAX_TRAILER_BYTES {
                        return (
                            at,
                            Err(Malformed("the response's trailer fields are longer than 16 KiB")),
                        );
                    }
                }
                State::Length(_) | State::UntilClose | State::Done => break,
            }
        }
        (at, Ok(()))
    }
}

/// The CRLF-terminated line at the front of `bytes` (without the CRLF); `None` while it is
/// incomplete.
fn line(bytes: &[u8]) -> Result<Option<&[u8]>, Malformed> {
    let window = &bytes[..bytes.len().min(MAX_LINE_BYTES + 2)];
    match window.iter().position(|&b| b == b'\n') {
        Some(end) if end > 0 && window[end - 1] == b'\r' => Ok(Some(&window[..end - 1])),
        Some(_) => Err(Malformed("a chunk-size or trailer line does not end in CRLF")),
        None if bytes.len() > MAX_LINE_BYTES + 1 => {
            Err(Malformed("a chunk-size or trailer line is longer than 4 KiB"))
        }
        None => Ok(None),
    }
}

/// The size on a chunk-size line: hex digits, then optional whitespace and extensions.
fn chunk_size(line: &[u8]) -> Result<u64, Malformed> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let rest = trim(&line[digits..]);
    if !(rest.is_empty() || rest[0] == b';') {
        return Err(Malformed("a chunk size is not a hexadecimal number"));
    }
    parse_digits(&line[..digits], 16).ok_or(Malformed("a chunk size is not a hexadecimal number of 64 bits"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn head(text: &str) -> Result<Option<Head>, Malformed> {
        parse_head(&mut BytesMut::from(text))
    }

    fn complete(text: &str) -> Head {
        head(text).unwrap().unwrap()
    }

    /// Decodes `wire` with `framing`, fed in the pieces `cuts` makes; returns the data and what is
    /// left over, or the error.
    fn decode_in_pieces(
        framing: Framing,
        wire: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, bool, Vec<u8>), Malformed> {
        let mut d = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        let mut from = 0;
        for &to in cuts.iter().chain([&wire.len()]) {
            buf.extend_from_slice(&wire[from..to]);
            from = to;
            let mut out = Gathered::default();
            d.decode(&mut buf, &mut out, usize::MAX)?;
            data.extend_from_slice(&out.take());
        }
        Ok((data, d.is_done(), buf.to_vec()))
    }

    #[test]
    fn a_request_goes_out_in_origin_form_with_the_endpoints_host_and_its_length() {
        let mut headers = HeaderMap::new();
        headers.insert(HOST, "router.example".parse().unwrap());
        headers.insert(CONNECTION, "keep-alive, X-Hop".parse().unwrap());
        headers.insert("x-hop", "only for this connection".parse().unwrap());
        headers.insert(CONTENT_LENGTH, "999".parse().unwrap());
        headers.insert(TRANSFER_ENCODING, "chunked".parse().unwrap());
        headers.insert(EXPECT, "100-continue".parse().unwrap());
        headers.insert("content-type", "application/json".parse().unwrap());
        headers.append("x-many", "1".parse().unwrap());
        headers.append("x-many", "2".parse().unwrap());
        let body = Bytes::from_static(b"{\"a\":1}");
        let req = Outgoing::new(
            &Method::POST,
            "/v1/completions?x=1",
            &headers,
            &"10.0.0.7:8000".parse().unwrap(),
            &body,
        );
        assert_eq!(
            String::from_utf8(req.parts().concat()).unwrap(),
            "POST /v1/completions?x=1 HTTP/1.1\r\nhost: 10.0.0.7:8000\r\ncontent-type: application/json\r\n\
             x-many: 1\r\nx-many: 2\r\ncontent-length: 7\r\n\r\n{\"a\":1}"
        );
        let get = Outgoing::new(
            &Method::GET,
            "/v1/models",
            &HeaderMap::new(),
            &"h".parse().unwrap(),
            &Bytes::new(),
        );
        assert_eq!(
            get.parts().concat(),
            b"GET /v1/models HTTP/1.1\r\nhost: h\r\n\r\n"
        );
        let long = Bytes::from(vec![b'x'; INLINE_BODY_BYTES + 1]);
        let req = Outgoing::new(
            &Method::POST,
            "/",
            &HeaderMap::new(),
            &"h".parse().unwrap(),
            &long,
        );
        let [head, body] = req.parts();
        assert!(head.ends_with(b"content-length: 16385\r\n\r\n"));
        assert_eq!(body, &long[..]);
    }

    #[test]
    fn a_head_is_parsed_only_when_complete_whatever_the_split() {
        let wire =
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n5\r\n";
        for cut in 0..wire.len() {
            let mut buf = BytesMut::from(&wire[..cut]);
            let parsed = parse_head(&mut buf).unwrap();
            let ends_head = wire[..cut].contains("\r\n\r\n");
            assert_eq!(parsed.is_some(), ends_head, "cut at {cut}");
            if let Some(h) = parsed {
                assert_eq!(h.framing, Framing::Chunked);
                assert!(h.keep_alive);
                assert_eq!(h.parts.headers.len(), 1, "transfer-encoding is not forwarded");
                assert_eq!(
                    &buf[..],
                    &wire.as_bytes()[wire.find("\r\n\r\n").unwrap() + 4..cut]
                );
            }
        }
    }

    #[test]
    fn framing_and_reuse_follow_rfc_9112() {
        let cases = [
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n",
                Framing::Length(12),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
                Framing::Empty,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\n",
                Framing::Length(3),
                true,
            ),
            (
                "HTTP/1.1 204 No Content\r\ncontent-length: 12\r\n\r\n",
                Framing::Empty,
                true,
            ),
            ("HTTP/1.1 304 Not Modified\r\n\r\n", Framing::Empty, true),
            ("HTTP/1.1 200 OK\r\n\r\n", Framing::UntilClose, false),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
                Framing::Chunked,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked,\r\n\r\n",
                Framing::Chunked,
                true,
            ),
            (
                "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n",
                Framing::Chunked,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n",
                Framing::UntilClose,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
                Framing::Chunked,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: x, Close\r\n\r\n",
                Framing::Length(5),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\n",
                Framing::Length(5),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 5\r\nconnection: keep-alive\r\n\r\n",
                Framing::Length(5),
                true,
            ),
        ];
        for (wire, framing, keep_alive) in cases {
            let h = complete(wire);
            assert_eq!((h.framing, h.keep_alive), (framing, keep_alive), "{wire:?}");
            if wire.contains("transfer-encoding: chunked") {
                assert!(!h.parts.headers.contains_key(CONTENT_LENGTH), "{wire:?}");
            }
        }
    }

    #[test]
    fn interim_responses_are_skipped_and_connection_scoped_fields_dropped() {
        let h = complete(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
             HTTP/1.1 503 Service Unavailable\r\nx-hop: 1\r\nconnection: keep-alive, X-Hop\r\nkeep-alive: timeout=5\r\n\
             upgrade: h2c\r\nretry-after: 3\r\ncontent-length: 2\r\n\r\n",
        );
        assert_eq!(h.parts.status, StatusCode::SERVICE_UNAVAILABLE);
        let mut names: Vec<&str> = h.parts.headers.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-length", "retry-after"]);
    }

    #[test]
    fn a_garbled_head_is_refused_with_its_reason() {
        let cases = [
            ("SSH-2.0-OpenSSH_9.6\r\n\r\n", "not HTTP/1.x"),
            ("HTTP/1.1 abc OK\r\n\r\n", "not HTTP/1.x"),
            ("HTTP/1.1 200 OK\r\nbad header\r\n\r\n", "not HTTP/1.x"),
            ("HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
            ("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "not a number"),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
                "not a number",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                "two different",
            ),
            ("HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n", "two different"),
        ];
        for (wire, reason) in cases {
            let e = head(wire).unwrap_err();
            assert!(e.0.contains(reason), "{wire:?}: {e}");
        }
        let many: String = (0..200).map(|i| format!("x-{i}: v\r\n")).collect();
        assert!(
            head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n"))
                .unwrap_err()
                .0
                .contains("128")
        );
        let huge = format!("HTTP/1.1 200 OK\r\nx: {}", "v".repeat(MAX_HEAD_BYTES));
        assert!(head(&huge).unwrap_err().0.contains("64 KiB"));
    }

    #[test]
    fn a_chunked_body_decodes_the_same_however_it_arrives() {
        let wire = b"5\r\nhello\r\n1;ext=\"a\"\r\n,\r\n6 \r\n world\r\n0\r\ntrailer: x\r\n\r\nHTTP/1.1";
        let (whole, done, rest) = decode_in_pieces(Framing::Chunked, wire, &[]).unwrap();
        assert_eq!(
            (whole.as_slice(), done, rest.as_slice()),
            (&b"hello, world"[..], true, &b"HTTP/1.1"[..])
        );
        for a in 0..wire.len() {
            for b in a..wire.len() {
                assert_eq!(
                    decode_in_pieces(Framing::Chunked, wire, &[a, b]).unwrap(),
                    (whole.clone(), true, rest.clone()),
                    "cut at {a} and {b}"
                );
            }
        }
        let byte_by_byte: Vec<usize> = (1..wire.len()).collect();
        assert_eq!(
            decode_in_pieces(Framing::Chunked, wire, &byte_by_byte).unwrap(),
            (whole, true, rest)
        );
    }

    #[test]
    fn a_length_body_stops_at_its_length_and_an_unclosed_one_at_the_close() {
        let (data, done, rest) = decode_in_pieces(Framing::Length(5), b"hello extra", &[2]).unwrap();
        assert_eq!(
            (data.as_slice(), done, rest.as_slice()),
            (&b"hello"[..], true, &b" extra"[..])
        );
        let mut d = Decoder::new(Framing::Length(5));
        assert!(!d.closed(), "a close before the length is a cut");
        let (data, done, _) = decode_in_pieces(Framing::UntilClose, b"all of it", &[3]).unwrap();
        assert_eq!((data.as_slice(), done), (&b"all of it"[..], false));
        let mut d = Decoder::new(Framing::UntilClose);
        assert!(d.closed());
        assert!(d.is_done());
        let mut d = Decoder::new(Framing::Chunked);
        assert!(!d.closed(), "a close inside a chunked body is a cut");
    }

    #[test]
    fn decoding_stops_at_the_limit_and_goes_on_from_there() {
        let mut d = Decoder::new(Framing::Chunked);
        let mut buf = BytesMut::from(&b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"[..]);
        let mut out = Gathered::default();
        d.decode(&mut buf, &mut out, 2).unwrap();
        assert_eq!(out.take(), "abc");
        d.decode(&mut buf, &mut out, 2).unwrap();
        assert_eq!(out.take(), "def");
        d.decode(&mut buf, &mut out, 2).unwrap();
        assert!(d.is_done() && out.is_empty() && buf.is_empty());
    }

    #[test]
    fn a_garbled_chunked_body_is_refused_with_its_reason() {
        let cases: [(&[u8], &str); 7] = [
            (b"2\nab\r\n", "does not end in CRLF"),
            (b"zz\r\n", "not a hexadecimal number"),
            (b"\r\n", "hexadecimal number of 64 bits"),
            (b"5x\r\n", "not a hexadecimal number"),
            (b"10000000000000000\r\n", "64 bits"),
            (b"2\r\nabc\r\n", "longer than its size"),
            (b"2\r\nab\n", "longer than its size"),
        ];
        for (wire, reason) in cases {
            let e = decode_in_pieces(Framing::Chunked, wire, &[]).unwrap_err();
            assert!(e.0.contains(reason), "{:?}: {e}", String::from_utf8_lossy(wire));
        }
        let long_line = [b"1;".as_slice(), &vec![b'x'; MAX_LINE_BYTES]].concat();
        assert!(
            decode_in_pieces(Framing::Chunked, &long_line, &[])
                .unwrap_err()
                .0
                .contains("4 KiB")
        );
        let trailers: Vec<u8> = [b"0\r\n".as_slice(), &b"t: v\r\n".repeat(4000)].concat();
        assert!(
            decode_in_pieces(Framing::Chunked, &trailers, &[])
                .unwrap_err()
                .0
                .contains("16 KiB")
        );
    }
}
