//! SVG chart of a sweep: completed throughput (req/s, x) against TTFT p99
//! (ms, y), one labelled marker per point joined in sweep order, the knee
//! circled in red and the SLO bound (if any) as a dashed horizontal line.
//! Points without a TTFT (no successful request) are omitted.

use crate::error::BenchError;
use crate::report::SweepReport;
use plotters::prelude::*;
use std::path::Path;

fn plot_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot(e.to_string())
}

/// Renders the chart to `path` (900×600 SVG).
pub fn write_svg(r: &SweepReport, path: &Path) -> Result<(), BenchError> {
    let pts: Vec<(usize, &str, f64, f64)> = r
        .points
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let y = p.stats.ttft_ms.p99_ms?;
            Some((i, p.load.label.as_str(), p.stats.request_throughput, y))
        })
        .collect();
    let slo = r.slo.as_ref().map(|s| s.ttft_p99_ms);
    let x_max = pts.iter().map(|p| p.2).fold(0.0_f64, f64::max).max(1e-3) * 1.15;
    let y_max = pts.iter().map(|p| p.3).chain(slo).fold(0.0_f64, f64::max).max(1e-3) * 1.15;

    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = match &r.knee {
        Some(k) => format!("{} — throughput vs TTFT p99 (knee: {})", r.config.model, k.label),
        None => format!("{} — throughput vs TTFT p99", r.config.model),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("throughput (completed req/s)")
        .y_desc("TTFT p99 (ms)")
        .draw()
        .map_err(plot_err)?;

    chart
        .draw_series(LineSeries::new(pts.iter().map(|p| (p.2, p.3)), BLUE.stroke_width(2)))
        .map_err(plot_err)?;
    chart.draw_series(pts.iter().map(|p| Circle::new((p.2, p.3), 4, BLUE.filled()))).map_err(plot_err)?;
    chart
        .draw_series(pts.iter().map(|p| {
            EmptyElement::at((p.2, p.3))
                + Text::new(p.1.to_string(), (6, -16), ("sans-serif", 13).into_font().color(&BLACK))
        }))
        .map_err(plot_err)?;

    if let Some(y) = slo {
        chart
            .draw_series(DashedLineSeries::new([(0.0, y), (x_max, y)], 8, 6, GREEN.stroke_width(2)))
            .map_err(plot_err)?
            .label(format!("SLO TTFT p99 {y} ms"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN));
    }
    if let Some(k) = &r.knee {
        if let Some(p) = pts.iter().find(|p| p.0 == k.index) {
            chart
                .draw_series([Circle::new((p.2, p.3), 10, RED.stroke_width(3))])
                .map_err(plot_err)?
                .label(format!("knee: {}", k.label))
                .legend(|(x, y)| Circle::new((x + 10, y), 5, RED.stroke_width(2)));
        }
    }
    if slo.is_some() || r.knee.is_some() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}
