import os
import sys

# tests/common.py is imported by test modules and by spawned ranks alike; so are the optimizer classes
# examples/shaped_optimizers.py defines.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
