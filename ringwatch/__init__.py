"""ringwatch: keeps the ring's driver (``ringd run``) alive.

Starts the driver (or, in ``restart_command`` mode, has the service manager
restart it), notices a dead or hung one, replaces it throttled like systemd's
``RestartSec`` / ``StartLimitBurst`` / ``StartLimitIntervalSec``, and gives up
loudly (exit 70) when the start limit is hit. See SPEC.md, "The watcher".
"""
