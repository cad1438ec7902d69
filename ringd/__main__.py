"""``python -m ringd`` - the same as the ``ringd`` console script (same name in
messages and for shell completion: ``_RINGD_COMPLETE``)."""
from .cli import main

if __name__ == "__main__":
    main(prog_name="ringd")
