"""Entry point of the engine's own process: ``python -m engine.engine_core_child ADDRESS`` (see engine_core).

A module apart, so that the classes the process pickles are ``engine.engine_core``'s, not ``__main__``'s.
"""

import sys

from engine.engine_core import child_main

if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
