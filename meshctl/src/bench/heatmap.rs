//! Heatmaps of a sweep: one panel per worker count, concurrency across, max
//! batch up, each cell coloured by its value and labelled with it. Drawn by
//! hand on plotters' SVG backend: categorical axes are simpler as rectangles
//! than as a chart's coordinate system.
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

/// The three axes of a sweep.
#[derive(Debug, Clone)]
pub struct Grid {
    pub workers: Vec<u32>,
    pub max_batch: Vec<u32>,
    pub concurrency: Vec<u32>,
}

const CELL: i32 = 84;
const LEFT: i32 = 90;
const TOP: i32 = 70;
const GAP: i32 = 50;
const LEGEND: i32 = 110;

/// Viridis, sampled at five stops and interpolated linearly.
fn colour(t: f64) -> RGBColor {
    const STOPS: [(u8, u8, u8); 5] = [
        (68, 1, 84),
        (59, 82, 139),
        (33, 145, 140),
        (94, 201, 98),
        (253, 231, 37),
    ];
    let t = t.clamp(0.0, 1.0) * (STOPS.len() - 1) as f64;
    let i = (t.floor() as usize).min(STOPS.len() - 2);
    let f = t - i as f64;
    let mix = |a: u8, b: u8| (a as f64 + (b as f64 - a as f64) * f).round() as u8;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

fn label(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn text<'a>(size: f64, h: HPos, colour: &'a RGBColor) -> TextStyle<'a> {
    TextStyle::from(("sans-serif", size).into_font())
        .color(colour)
        .pos(Pos::new(h, VPos::Center))
}

/// The drawing surface of one heatmap.
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Writes an SVG heatmap of `value(workers, max_batch, concurrency)`.
pub fn write_svg(
    path: &Path,
    title: &str,
    grid: &Grid,
    value: impl Fn(u32, u32, u32) -> Option<f64>,
) -> anyhow::Result<()> {
    let (nx, ny, np) = (
        grid.concurrency.len() as i32,
        grid.max_batch.len() as i32,
        grid.workers.len() as i32,
    );
    let panel_w = nx * CELL;
    let width = LEFT + np * panel_w + (np - 1) * GAP + LEGEND;
    let height = TOP + ny * CELL + 70;
    let values: Vec<f64> = grid
        .workers
        .iter()
        .flat_map(|&w| {
            grid.max_batch
                .iter()
                .flat_map(move |&b| grid.concurrency.iter().map(move |&c| (w, b, c)))
        })
        .filter_map(|(w, b, c)| value(w, b, c))
        .collect();
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let scale = |v: f64| if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };

    let root = SVGBackend::new(path, (width as u32, height as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    root.draw(&Text::new(
        title.to_string(),
        (width / 2, 24),
        text(18.0, HPos::Center, &BLACK),
    ))?;
    root.draw(&Text::new(
        "max batch".to_string(),
        (LEFT - 10, TOP - 12),
        text(13.0, HPos::Right, &BLACK),
    ))?;
    for (p, &w) in grid.workers.iter().enumerate() {
        let x0 = LEFT + p as i32 * (panel_w + GAP);
        draw_panel(&root, grid, x0, p == 0, |b, c| {
            value(w, b, c).map(|v| (v, scale(v)))
        })?;
        let noun = if w == 1 { "worker" } else { "workers" };
        root.draw(&Text::new(
            format!("{w} {noun}"),
            (x0 + panel_w / 2, TOP - 16),
            text(15.0, HPos::Center, &BLACK),
        ))?;
    }
    draw_legend(
        &root,
        width - LEGEND + 30,
        ny * CELL,
        lo.is_finite().then_some((lo, hi)),
    )?;
    root.present()?;
    Ok(())
}

/// One panel (one worker count) with its left edge at `x0`: a cell per
/// (max batch, concurrency), coloured by `cell(b, c)` = (value, 0..1 scale).
fn draw_panel(
    root: &Area,
    grid: &Grid,
    x0: i32,
    first: bool,
    cell: impl Fn(u32, u32) -> Option<(f64, f64)>,
) -> anyhow::Result<()> {
    let ny = grid.max_batch.len() as i32;
    let panel_w = grid.concurrency.len() as i32 * CELL;
    for (iy, &b) in grid.max_batch.iter().enumerate() {
        // The smallest batch at the bottom.
        let y0 = TOP + (ny - 1 - iy as i32) * CELL;
        if first {
            root.draw(&Text::new(
                b.to_string(),
                (x0 - 10, y0 + CELL / 2),
                text(14.0, HPos::Right, &BLACK),
            ))?;
        }
        for (ix, &c) in grid.concurrency.iter().enumerate() {
            let cx = x0 + ix as i32 * CELL;
            let v = cell(b, c);
            let fill = v.map(|(_, t)| colour(t)).unwrap_or(RGBColor(200, 200, 200));
            root.draw(&Rectangle::new(
                [(cx, y0), (cx + CELL - 2, y0 + CELL - 2)],
                fill.filled(),
            ))?;
            let ink = if v.map(|(_, t)| t).unwrap_or(1.0) > 0.55 {
                BLACK
            } else {
                WHITE
            };
            root.draw(&Text::new(
                v.map(|(v, _)| label(v)).unwrap_or_else(|| "failed".into()),
                (cx + CELL / 2 - 1, y0 + CELL / 2 - 1),
                text(15.0, HPos::Center, &ink),
            ))?;
        }
    }
    for (ix, &c) in grid.concurrency.iter().enumerate() {
        root.draw(&Text::new(
            c.to_string(),
            (x0 + ix as i32 * CELL + CELL / 2, TOP + ny * CELL + 14),
            text(14.0, HPos::Center, &BLACK),
        ))?;
    }
    root.draw(&Text::new(
        "concurrency".to_string(),
        (x0 + panel_w / 2, TOP + ny * CELL + 38),
        text(13.0, HPos::Center, &BLACK),
    ))?;
    Ok(())
}

/// The colour bar at `lx`, low at the bottom and high at the top, labelled
/// with the range when there is one.
fn draw_legend(root: &Area, lx: i32, bar_h: i32, range: Option<(f64, f64)>) -> anyhow::Result<()> {
    for i in 0..bar_h {
        let t = 1.0 - i as f64 / bar_h as f64;
        root.draw(&Rectangle::new(
            [(lx, TOP + i), (lx + 18, TOP + i + 1)],
            colour(t).filled(),
        ))?;
    }
    if let Some((lo, hi)) = range {
        root.draw(&Text::new(
            label(hi),
            (lx + 24, TOP + 6),
            text(12.0, HPos::Left, &BLACK),
        ))?;
        root.draw(&Text::new(
            label(lo),
            (lx + 24, TOP + bar_h - 6),
            text(12.0, HPos::Left, &BLACK),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_heatmap_with_every_value() {
        let grid = Grid {
            workers: vec![1, 2],
            max_batch: vec![1, 4],
            concurrency: vec![1, 4, 16],
        };
        let dir = std::env::temp_dir().join(format!("heatmap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.svg");
        write_svg(&path, "tokens/s", &grid, |w, b, c| {
            (c != 16 || w != 2).then_some((w * b * c) as f64)
        })
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("tokens/s") && svg.contains("64.0") && svg.contains("failed"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn colours_run_from_purple_to_yellow() {
        assert_eq!(colour(0.0), RGBColor(68, 1, 84));
        assert_eq!(colour(1.0), RGBColor(253, 231, 37));
    }
}
