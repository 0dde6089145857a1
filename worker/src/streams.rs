//! The streams running on this worker, by name ([`StreamKey`]: the client's
//! request id and the caller's attempt id), so that a Generate cannot take a
//! name that is in use and an Abort knows, without asking the engine thread,
//! whether the stream it names is running.
use crate::scheduler::StreamKey;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// Every stream whose reply is still being sent.
#[derive(Clone, Debug, Default)]
pub struct LiveStreams(Arc<Mutex<HashSet<StreamKey>>>);

impl LiveStreams {
    /// Takes `key` for a new stream until the returned guard drops; None if
    /// a running stream has it.
    pub fn claim(&self, key: StreamKey) -> Option<LiveStream> {
        let fresh = self
            .0
            .lock()
            .expect("live streams lock")
            .insert(key.clone());
        fresh.then(|| LiveStream {
            streams: self.clone(),
            key,
        })
    }

    /// Whether a stream named `key` is running.
    pub fn contains(&self, key: &StreamKey) -> bool {
        self.0.lock().expect("live streams lock").contains(key)
    }
}

/// A claimed stream name, given back when dropped (the reply has ended).
#[derive(Debug)]
pub struct LiveStream {
    streams: LiveStreams,
    key: StreamKey,
}

impl Drop for LiveStream {
    fn drop(&mut self) {
        self.streams
            .0
            .lock()
            .expect("live streams lock")
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(request_id: &str, attempt_id: &str) -> StreamKey {
        StreamKey {
            request_id: request_id.into(),
            attempt_id: attempt_id.into(),
        }
    }

    #[test]
    fn a_name_is_taken_until_its_stream_ends() {
        let live = LiveStreams::default();
        let a = live.claim(key("r", "a")).unwrap();
        assert!(live.claim(key("r", "a")).is_none(), "taken");
        let b = live
            .claim(key("r", "b"))
            .expect("same request, another attempt");
        assert!(live.contains(&key("r", "a")) && live.contains(&key("r", "b")));
        drop(a);
        assert!(!live.contains(&key("r", "a")));
        assert!(live.contains(&key("r", "b")));
        assert!(live.claim(key("r", "a")).is_some(), "free again");
        drop(b);
    }
}
