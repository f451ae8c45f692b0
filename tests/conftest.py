import os
import sys

# The distributed harness lives next to the tests and is imported by module name in spawned ranks.
sys.path.insert(0, os.path.dirname(__file__))
