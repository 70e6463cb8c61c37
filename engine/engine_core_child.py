"""Entry point of the engine's own process: ``python -m engine.engine_core_child ADDRESS`` (see engine_core).

A module apart, so that the classes the process pickles are ``engine.engine_core``'s, not ``__main__``'s.

The process ends with ``os._exit`` once its loop is over, as multiprocessing's children do: the interpreter's
own shutdown would run a final garbage collection over every object torch and the model left, which took ~2 s
on the 2-core benchmark machine, and a replica that stops or is redeployed waits for it. Nothing needs
finalizing: the memory goes back with the process, and the logs are flushed first.
"""

import logging
import os
import sys

from inflight.engine.engine_core import child_main

if __name__ == "__main__":
    code = child_main(sys.argv[1])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
