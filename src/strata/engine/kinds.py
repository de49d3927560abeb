"""Entry kinds: the numbers stored in every directory entry (docs/format.md).

Kept apart from `objects.py`, which re-exports them, so that code that only
shows entries (the CLI's fast `ls`) needs neither dataclasses nor the codecs.
"""

from __future__ import annotations

import stat as statmod

K_FILE = 1
K_DIR = 2
K_SYMLINK = 3
K_FIFO = 4
K_CHR = 5
K_BLK = 6
K_SOCK = 7
ENTRY_KIND_NAMES = {K_FILE: "file", K_DIR: "dir", K_SYMLINK: "symlink", K_FIFO: "fifo",
                    K_CHR: "chardev", K_BLK: "blockdev", K_SOCK: "socket"}
IFMT = {K_FILE: statmod.S_IFREG, K_DIR: statmod.S_IFDIR, K_SYMLINK: statmod.S_IFLNK,
        K_FIFO: statmod.S_IFIFO, K_CHR: statmod.S_IFCHR, K_BLK: statmod.S_IFBLK,
        K_SOCK: statmod.S_IFSOCK}
KIND_OF_IFMT = {fmt: kind for kind, fmt in IFMT.items()}  # st_mode's file type -> kind
