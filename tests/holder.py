"""A stand-in GPU user for the reap tests: holds stand-in device files the way CUDA processes do.

    python holder.py fd FILE...      open each file and keep the fd
    python holder.py mmap FILE...    map each file, then close the fd (held by the mapping only)
    options: --ignore-term  --handle-term (exits 0 on SIGTERM, as a trainer after its checkpoint)
             --children N  --new-group  --orphan (double fork)
Prints `ready (pid: N)` once it holds everything (dumb-init's habit), then sleeps.
"""

import ctypes
import os
import signal
import sys
import time

args = sys.argv[1:]
mode = args.pop(0)
flags = {a for a in args if a.startswith("--")}
files = [a for a in args if not a.startswith("--") and not a.isdigit()]
children = int(args[args.index("--children") + 1]) if "--children" in args else 0

if "--new-group" in flags:
    os.setpgid(0, 0)
if "--orphan" in flags:
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        print(os.read(r, 100).decode().strip(), flush=True)  # the grandchild's ready line
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    os.close(r)
    sys.stdout = os.fdopen(w, "w")
if "--ignore-term" in flags:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--handle-term" in flags:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

kept = []
for path in files:
    if mode == "fd":
        kept.append(open(path, "rb"))
    else:
        # libc mmap, then close: Python's mmap module keeps a dup of the fd, which would hold by fd.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        fd = os.open(path, os.O_RDONLY)
        addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        os.close(fd)

kids = []
for _ in range(children):
    pid = os.fork()
    if pid == 0:
        for f in kept:
            f.close()  # the children hold nothing themselves (mappings stay, as after a CUDA fork)
        while True:
            time.sleep(1)
    kids.append(pid)

print(f"ready (pid: {os.getpid()}) children {' '.join(map(str, kids))}", flush=True)
if "--orphan" in flags:
    sys.stdout.close()
while True:
    time.sleep(1)
