"""ring: a single-host relay-ring supervisor. ``ringd`` is the driver and the operator CLI."""
__version__ = "0.1.0"
