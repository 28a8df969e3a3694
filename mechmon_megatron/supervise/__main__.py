"""``python -m mechmon_megatron.supervise [options] -- COMMAND...``"""

import sys

from mechmon_megatron.supervise.cli import main

if __name__ == "__main__":
    sys.exit(main())
