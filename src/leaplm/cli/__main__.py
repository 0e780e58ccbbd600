"""`python -m leaplm.cli ...`: the same as `leaplm ...`."""
from . import app

app()
