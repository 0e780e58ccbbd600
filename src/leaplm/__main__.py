"""`python -m leaplm ...` runs the same command-line interface as the `leaplm` script."""
from .cli import app

if __name__ == "__main__":
    app()
