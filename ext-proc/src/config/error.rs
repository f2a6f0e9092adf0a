//! The config's one error type: every error names the file or the field.

/// Errors from loading the sidecar configuration. Each names the file or the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The config file's path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML did not match the schema (unknown field, wrong type, missing field).
    #[error("{path}: {message}")]
    Parse {
        /// The config file's path.
        path: String,
        /// serde's message, which names the field and the line.
        message: String,
    },
    /// A value parsed but is not valid.
    #[error("{field}: {message}")]
    Invalid {
        /// Dotted path of the offending field, e.g. `tenants[0].id`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}
