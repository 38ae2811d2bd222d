//! gameday
