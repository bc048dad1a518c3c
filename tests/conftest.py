import os
import sys

# tests/common.py is imported by test modules and by spawned ranks alike.
sys.path.insert(0, os.path.dirname(__file__))
