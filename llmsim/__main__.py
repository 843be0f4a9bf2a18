"""``python -m llmsim`` runs the same entry point as the ``llmsim`` console script."""

from llmsim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
