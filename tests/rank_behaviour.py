"""What test_harness.py runs on ranks with distributed_harness.run_module: each rank writes a line to stdout (Python)
with torch's thread count, a temporary file and a line naming its directory, and one line to stderr (the file
descriptor, as a C library would); then, by its argument: `ok` ends; `fail`: rank 1 ends with status 3 while the
others sleep a minute; `hang`: every rank sleeps a minute; `port-taken FILE`: rank 0 fails as a store whose port
was taken does, unless FILE exists (it makes it), and then the ranks end."""
import os
import sys
import tempfile
import time

import torch

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"rank {rank} of {world_size}, {torch.get_num_threads()} thread(s), in {os.getcwd()}")
os.close(tempfile.mkstemp()[0])
print(f"temporary files in {tempfile.gettempdir()}")
os.write(2, f"rank {rank} on fd 2\n".encode())
what = sys.argv[1]
if what == "fail" and rank == 1:
    sys.exit(3)
if what == "port-taken" and rank == 0 and not os.path.exists(sys.argv[2]):
    open(sys.argv[2], "w").close()
    sys.exit(f"torch.distributed.DistNetworkError: port: {os.environ['MASTER_PORT']}, name: EADDRINUSE")
if what not in ("ok", "port-taken"):
    time.sleep(60)
