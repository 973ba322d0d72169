//! Shadow-model property test.
