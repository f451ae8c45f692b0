"""What test_harness.py runs on ranks with distributed_harness.run_module: each rank writes a line to stdout (Python)
with torch's thread count, a temporary file and a line naming its directory, and one line to stderr (the file
descriptor, as a C library would); then, by its argument: `ok` ends; `fail`: rank 1 ends with status 3 while the
others sleep a minute; `hang`: every rank sleeps a minute."""
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
if what != "ok":
    time.sleep(60)
