"""`python -m foundation.world_exit CODE`: prints, then exits with CODE (tests/foundation/test_worlds.py)."""
import sys

if __name__ == "__main__":
    print(f"exiting with {sys.argv[1]}", flush=True)
    sys.exit(int(sys.argv[1]))
