"""The daemons' loops: driver, hop, leader, reaper, metrics and the watcher."""
