"""`python -m leaplm.server ...`: the same as `leaplm serve ...`."""
from ..cli.serve import main

if __name__ == "__main__":
    main()
