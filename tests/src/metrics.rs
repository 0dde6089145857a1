//! The plaintext listener of `--metrics-listen`, as Prometheus and platform
//! probes use it: `/metrics` scraped, `/healthz` and `/readyz` asked.
use anyhow::{Context, Result};
use std::collections::BTreeSet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET path` on `addr` (`host:port`) over plain HTTP/1.1, as a probe with no
/// client certificate sends it: the status code and the body.
pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics listener {addr}"))?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).await?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {path} on {addr}: no HTTP answer: {answer:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("GET {path} on {addr}: no status in {head:?}"))?;
    Ok((status, body.to_string()))
}

/// The body of `GET /metrics` on `addr` (`host:port`).
pub async fn scrape_text(addr: &str) -> Result<String> {
    let (status, body) = http_get(addr, "/metrics").await?;
    anyhow::ensure!(status == 200, "GET /metrics on {addr}: {status} {body}");
    Ok(body)
}

/// `GET /metrics` on `addr`, parsed.
pub async fn scrape(addr: &str) -> prometheus_parse::Scrape {
    let text = scrape_text(addr).await.expect("scraping /metrics");
    let lines = text.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).expect("Prometheus text format")
}

/// The sum of the samples of `name` (its bare name, or with labels) whose
/// line also contains `containing` (a label value, quoted or not), in a
/// scrape's text.
pub fn sum_of(text: &str, name: &str, containing: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(containing))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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
