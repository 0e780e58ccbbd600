"""`python -m leaplm.server ...`: the same as `leaplm serve ...`."""
import typer

from .cli_serve import serve

if __name__ == "__main__":
    typer.run(serve)
