"""Looking at what ring shows a person: a real headless Chromium, a PNG reader, a private tmux.

Every process started here is ended by pid in a finaliser: Chromium's whole
tree (and any helper of it that left its session, found by the private
profile directory on its command line), and the tmux server on its own socket
(``kill-server``, then its pid).
"""
from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import psutil

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium_binary() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _end_tree(pid: int, marker: str) -> None:
    """SIGKILL ``pid``, its descendants, its process group, and every process
    whose command line names ``marker`` (a helper that left the session)."""
    victims: List[psutil.Process] = []
    try:
        root = psutil.Process(pid)
        victims = root.children(recursive=True) + [root]
    except psutil.Error:
        pass
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                victims.append(p)
        except psutil.Error:
            continue
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    psutil.wait_procs(victims, timeout=10)


def chromium(tmp: Path, *args: str, timeout: float = 60) -> Tuple[bytes, bytes]:
    """Run headless Chromium once (its own profile under ``tmp``); (stdout, stderr)."""
    binary = chromium_binary()
    assert binary, "chromium is not installed (.ci/run installs Debian's chromium)"
    profile = tmp / f"chromium-profile-{time.monotonic_ns()}"
    argv = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env=dict(os.environ, HOME=str(tmp)))
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        _end_tree(p.pid, str(profile))
    assert p.returncode == 0, f"chromium exited {p.returncode}: {err[-2000:]!r}"
    return out, err


# --- PNG ----------------------------------------------------------------------------------------------

def read_png(path: Path) -> Tuple[int, int, List[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA, non-interlaced PNG (stdlib only)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks, idat = 8, {}, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IDAT":
            idat += body
        else:
            chunks[kind] = body
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: List[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        ftype, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        _unfilter(ftype, line, prev, bpp)
        rows.append(bytes(line) if bpp == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3))
        prev = line
    return width, height, rows


def _unfilter(ftype: int, line: bytearray, prev: bytearray, bpp: int) -> None:
    if ftype == 0:
        return
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        b = prev[i]
        if ftype == 1:
            line[i] = (line[i] + a) & 255
        elif ftype == 2:
            line[i] = (line[i] + b) & 255
        elif ftype == 3:
            line[i] = (line[i] + ((a + b) >> 1)) & 255
        elif ftype == 4:
            c = prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        else:
            raise AssertionError(f"bad PNG filter {ftype}")


def colour_counts(rows: Sequence[bytes], top: int = 0, bottom: Optional[int] = None, left: int = 0) -> Dict[
        Tuple[int, int, int], int]:
    """How many pixels of each colour in the rows ``top:bottom``, from column ``left``."""
    counts: Dict[Tuple[int, int, int], int] = {}
    for line in rows[top:bottom]:
        for i in range(left * 3, len(line) - 2, 3):
            key = (line[i], line[i + 1], line[i + 2])
            counts[key] = counts.get(key, 0) + 1
    return counts


def hex_rgb(colour: str) -> Tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


# --- tmux ---------------------------------------------------------------------------------------------

class Tmux:
    """A tmux server of the test's own (``-S`` socket under ``tmp``, no user config, no status line)."""

    def __init__(self, tmp: Path, env: Dict[str, str]):
        folder = tmp / "tmux"
        folder.mkdir(mode=0o700, exist_ok=True)
        self.sock = str(folder / "sock")
        self.env = env
        self.server_pid: Optional[int] = None

    def __call__(self, *args: str) -> str:
        res = subprocess.run(["tmux", "-S", self.sock, *args], capture_output=True, text=True, timeout=30,
                             env=self.env)
        assert res.returncode == 0, f"tmux {' '.join(args)}: {res.stderr}"
        return res.stdout

    def start(self, command: str, width: int = 120, height: int = 40) -> None:
        self("-f", "/dev/null", "new-session", "-d", "-x", str(width), "-y", str(height), command)
        self.server_pid = int(self("display-message", "-p", "#{pid}").strip())
        self("set-option", "-g", "status", "off")

    def screen(self, escapes: bool = False) -> List[str]:
        return self("capture-pane", "-p", *(["-e"] if escapes else [])).split("\n")

    def show(self, fmt: str) -> str:
        return self("display-message", "-p", fmt).strip()

    def pane_processes(self) -> List[psutil.Process]:
        pane = psutil.Process(int(self.show("#{pane_pid}")))
        return [pane] + pane.children(recursive=True)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True, timeout=30, env=self.env)
        if self.server_pid is not None:
            try:
                server = psutil.Process(self.server_pid)
                victims = server.children(recursive=True) + [server]
            except psutil.Error:
                victims = []
            for p in victims:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(victims, timeout=10)
