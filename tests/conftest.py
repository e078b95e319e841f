import os
import sys

# Large buffers stay in malloc's arena (see bmfs/__init__.py); tests import bmfs first.
sys.dont_write_bytecode = False
os.environ.setdefault("BMFS_TEST", "1")
