"""Write fixed-size records to FILE, each made durable, and report each acknowledged one.

Prints the record's number on stdout only after the record is durable by the
round's way of asking (ROUND picks it, so twenty rounds try each several times):

- fsync:     append, then fsync(2)
- fdatasync: overwrite in place in a file written (and fsynced) beforehand,
             then fdatasync(2): no metadata changes, so ext4 flushes without
             a journal commit
- dsync:     append through an O_DSYNC descriptor (the write returns once durable)
- osync:     overwrite in place through an O_SYNC descriptor
- sync:      append, then sync(2) of everything

The test counts everything printed as acknowledged, so all of it must survive.
"""

import os
import sys

MODES = ("fsync", "fdatasync", "dsync", "osync", "sync")
RECORD = 512
AHEAD = 4 << 20  # bytes written in place beforehand for the overwriting modes

path, round_ = sys.argv[1], int(sys.argv[2])
mode = MODES[round_ % len(MODES)]
if mode in ("fdatasync", "osync"):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, bytes(AHEAD))  # real zeros: blocks allocated and written, not unwritten
    os.fsync(fd)
    os.close(fd)
flags = {"dsync": os.O_DSYNC | os.O_APPEND, "osync": os.O_SYNC,
         "fdatasync": 0}.get(mode, os.O_APPEND)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
sys.stderr.write(f"mode {mode}\n")
seq = 0
while True:
    seq += 1
    record = f"{seq:08d}".encode().ljust(RECORD, b".")[:RECORD - 1] + b"\n"
    if mode in ("fdatasync", "osync"):
        if seq * RECORD > AHEAD:
            break
        os.pwrite(fd, record, (seq - 1) * RECORD)
    else:
        os.write(fd, record)
    if mode == "fsync":
        os.fsync(fd)
    elif mode == "fdatasync":
        os.fdatasync(fd)
    elif mode == "sync":
        os.sync()
    sys.stdout.write(f"{seq}\n")
    sys.stdout.flush()
