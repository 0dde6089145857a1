//! The gRPC deadline a caller set (`grpc-timeout` header), so that every hop
//! can pass on what is left of it.
use std::time::Duration;
use tonic::metadata::MetadataMap;

/// Parses `grpc-timeout` (an integer of at most 8 digits and a unit: H, M, S,
/// m, u or n), as the gRPC over HTTP/2 protocol defines it.
pub fn grpc_timeout(md: &MetadataMap) -> Option<Duration> {
    let v = md.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (num, unit) = v.split_at(v.len() - 1);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(v: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert("grpc-timeout", v.parse().unwrap());
        m
    }

    #[test]
    fn parses_every_unit() {
        assert_eq!(grpc_timeout(&md("2S")), Some(Duration::from_secs(2)));
        assert_eq!(
            grpc_timeout(&md("1500m")),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(grpc_timeout(&md("3M")), Some(Duration::from_secs(180)));
        assert_eq!(grpc_timeout(&md("7u")), Some(Duration::from_micros(7)));
        assert_eq!(grpc_timeout(&md("1H")), Some(Duration::from_secs(3600)));
        assert_eq!(grpc_timeout(&md("5n")), Some(Duration::from_nanos(5)));
    }

    #[test]
    fn rejects_malformed_values() {
        assert_eq!(grpc_timeout(&md("S")), None);
        assert_eq!(grpc_timeout(&md("10x")), None);
        assert_eq!(grpc_timeout(&md("123456789S")), None);
        assert_eq!(grpc_timeout(&MetadataMap::new()), None);
    }
}
