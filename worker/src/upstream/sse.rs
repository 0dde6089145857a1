//! A Server-Sent Events parser for the engines' streaming responses: bytes
//! in, the `data` of each complete event out (WHATWG HTML, "Parsing an event
//! stream"; `event`, `id` and `retry` fields and comments are read and
//! ignored, since the engines send data-only events).
use super::error::UpstreamError;

/// The longest line an engine may send (one event's data): a bound, so a
/// stream without line breaks cannot grow the buffer without end.
pub const MAX_LINE_BYTES: usize = 4 << 20;

/// Incremental parser state: the unfinished line and the event's data so far.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Feeds `bytes`; returns the data of every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, UpstreamError> {
        let mut events = Vec::new();
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if let Some(data) = self.line_done(&line)? {
                events.push(data);
            }
        }
        self.line.extend_from_slice(rest);
        if self.line.len() > MAX_LINE_BYTES {
            return Err(UpstreamError::Malformed(format!(
                "an SSE line longer than {MAX_LINE_BYTES} bytes"
            )));
        }
        Ok(events)
    }

    /// One complete line; an event's data when the line is the blank one
    /// that ends it.
    fn line_done(&mut self, line: &[u8]) -> Result<Option<String>, UpstreamError> {
        if line.is_empty() {
            return Ok(self.data.take());
        }
        let line = std::str::from_utf8(line)
            .map_err(|_| UpstreamError::Malformed("an SSE line that is not UTF-8".into()))?;
        if line.starts_with(':') {
            return Ok(None);
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\r\nevent: x\ndata: one\ndata: two\r\n\r\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut p = SseParser::default();
            let mut got = p.push(&stream[..cut]).unwrap();
            got.extend(p.push(&stream[cut..]).unwrap());
            assert_eq!(got, ["{\"a\":1}", "one\ntwo", "[DONE]"], "cut at {cut}");
        }
    }

    #[test]
    fn an_unfinished_event_is_not_delivered() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: partial\n").unwrap().is_empty());
        assert!(p.push(b"data:no-space").unwrap().is_empty());
        assert_eq!(p.push(b"\n\n").unwrap(), ["partial\nno-space"]);
    }

    #[test]
    fn bad_bytes_and_endless_lines_are_malformed() {
        let mut p = SseParser::default();
        assert!(matches!(
            p.push(b"data: \xff\n"),
            Err(UpstreamError::Malformed(_))
        ));
        let mut p = SseParser::default();
        let long = vec![b'x'; MAX_LINE_BYTES + 1];
        assert!(matches!(p.push(&long), Err(UpstreamError::Malformed(_))));
    }
}
