"""Append fixed-size records to FILE, fsync each, and report each acknowledged one.

Prints the record's number on stdout only after fsync returned: the test
counts everything printed as acknowledged, so all of it must survive.
"""

import os
import sys

path = sys.argv[1]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
seq = 0
while True:
    seq += 1
    os.write(fd, f"{seq:08d}".encode().ljust(512, b".")[:511] + b"\n")
    os.fsync(fd)
    sys.stdout.write(f"{seq}\n")
    sys.stdout.flush()
