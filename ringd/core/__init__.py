"""Pure decisions and types: no clock, no files, no processes."""
