"""What the operator writes: config, roster, schedules and time spans, read into core types."""
