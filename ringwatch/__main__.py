"""``python -m ringwatch`` - the same as the ``ringwatch`` console script."""
from .cli import main

if __name__ == "__main__":
    main()
