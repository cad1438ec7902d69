"""The kinds of event ring raises an alert on (``alerts.command``; SPEC "Alerts"):
one name each, for the pure rules that decide them (``policy.alerts_after``) and
the code that sends them (``alerts``), which a helper process imports alone."""

QUARANTINED = "quarantined"
FAILURES = "failures"
WATCHER_GAVE_UP = "watcher-gave-up"
DRIVER_REPLACED = "driver-replaced"
RUN_REAPED = "run-reaped"
SILENT = "silent"                    # an agent with no ok run for alerts.silent_after (ringd.core.silence)
PAUSED_TOO_LONG = "paused_too_long"  # a pause older than alerts.paused_longer_than
