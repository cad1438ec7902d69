"""The operating system behind one seam: processes, cgroups, sockets, locks, files, signals."""
