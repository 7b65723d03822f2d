"""``python -m benchmarks [SECTION ...]``: see ``benchmarks.cli``."""

from benchmarks.cli import main

if __name__ == "__main__":
    main()
