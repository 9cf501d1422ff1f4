"""`python -m polyrunner ...` is the `polyrunner` command line."""

from polyrunner.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
