//! Scraping a process's Prometheus `/metrics` listener, as Prometheus would.
use anyhow::{Context, Result};
use std::collections::BTreeSet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET /metrics` on `addr` (`host:port`), over plain HTTP/1.1.
pub async fn scrape_text(addr: &str) -> Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics listener {addr}"))?;
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default())
}

/// `GET /metrics` on `addr`, parsed.
pub async fn scrape(addr: &str) -> prometheus_parse::Scrape {
    let text = scrape_text(addr).await.expect("scraping /metrics");
    let lines = text.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).expect("Prometheus text format")
}

/// Every series name in a scrape's text, exactly as PromQL selects it: a
/// histogram appears as its `_bucket`, `_sum` and `_count` series, never under
/// its bare name.
pub fn series_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(|c: char| c == '{' || c.is_whitespace()).next())
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}
