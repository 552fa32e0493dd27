//! The integration tests, one binary: each module covers one area.

mod metrics_live;
