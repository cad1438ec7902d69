"""``python -m ringd`` - the same as the ``ringd`` console script (same name in
messages and for shell completion: ``_RINGD_COMPLETE``)."""
from ringd.cli.commands import main

if __name__ == "__main__":
    main(prog_name="ringd")
