//! A server-sent event stream, cut into pieces where the input says, through both readers: the
//! prober's decoder (events out of a completion stream) and the router's event splitter (which
//! holds back a half event). Neither panics; the splitter passes on exactly what came in, in
//! order, once the stream has been flushed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use understudy_prober::probe::sse::SseDecoder;
use understudy_router::continuation::Events;

fuzz_target!(|data: &[u8]| {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);
    let mut decoder = SseDecoder::default();
    let mut events = Events::default();
    let mut passed = Vec::new();
    for piece in stream.chunks(step) {
        let _ = decoder.push(piece);
        passed.extend_from_slice(&events.push(piece, |_| {}));
    }
    let _ = decoder.finish();
    assert!(
        stream.starts_with(&passed),
        "the splitter passed on what never came in"
    );
});
