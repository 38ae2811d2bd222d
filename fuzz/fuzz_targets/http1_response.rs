//! A replica's HTTP/1.1 response, as the router's upstream codec reads it: the head, then the
//! body under the framing the head gave, fed in two pieces split where the input says. Whatever
//! the bytes, the codec answers a head, "need more", or `Malformed`; it never panics, and a body
//! never comes out larger than what went in.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use understudy_router::upstream::codec::{Decoder, Gathered, parse_head};

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let at = usize::from(split).min(rest.len());
    let mut buf = BytesMut::from(&rest[..at]);
    let mut pending = &rest[at..];
    let head = loop {
        match parse_head(&mut buf) {
            Ok(Some(head)) => break head,
            Ok(None) if !pending.is_empty() => {
                buf.extend_from_slice(pending);
                pending = &[];
            }
            Ok(None) | Err(_) => return,
        }
    };
    let mut decoder = Decoder::new(head.framing);
    let mut out = Gathered::default();
    buf.extend_from_slice(pending);
    let fed = buf.len();
    if decoder.decode(&mut buf, &mut out, 1 << 20).is_ok() {
        assert!(out.len() <= fed, "decoded {} bytes from {fed}", out.len());
    }
    let _ = decoder.closed();
});
