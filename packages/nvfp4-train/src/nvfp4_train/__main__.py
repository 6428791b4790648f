"""`python -m nvfp4_train` is `nvfp4-train`."""

import sys

from nvfp4_train.cli import main

if __name__ == "__main__":
    sys.exit(main())
