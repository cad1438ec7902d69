"""The operator's commands: a thin layer of click over functions tests call too."""
