//! Error type of the benchmark tool (configuration, I/O and output errors;
//! per-request failures are *measurements*, see [`crate::metrics::ErrorClass`]).

use std::path::PathBuf;

/// Errors that abort a benchmark run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag or configuration value is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The dataset file could not be used.
    #[error("dataset {path}: {message}")]
    Dataset {
        /// Dataset file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// File involved.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Building the async runtime failed.
    #[error("runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// JSON serialization failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// CSV serialization failed.
    #[error("csv: {0}")]
    Csv(#[from] csv::Error),
    /// Rendering the SVG chart failed.
    #[error("plot: {0}")]
    Plot(String),
    /// Creating a histogram failed.
    #[error("histogram: {0}")]
    Histogram(String),
}

impl BenchError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}
